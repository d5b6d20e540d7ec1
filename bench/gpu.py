"""The GPU rows (issue 21, item 6): a rank's state on a CUDA device, staged by
``save()`` and restored from the local tier, each beside its floor measured in the
same run on the same bytes.

    python -m bench.gpu                       # 4 GiB on cuda:0, 3 rounds
    python -m bench.gpu --size 1G --rounds 5
    python -m bench.gpu --device cpu --size 64M   # the harness itself, on the CPU

Rows:

- ``save()`` stall (``save()`` then ``staged()``: until the tensors may change)
  into a warm staging pool, against a pinned device-to-host copy of every tensor
  (one synchronize at the end); ckptd's design target: the stall <= 1.2x that
  copy;
- restore from the local tier (this rank's pool in /dev/shm, as a restarted
  process finds it: not page-locked in the restoring process) into the
  existing CUDA tensors, atomic and ``atomic=False``, against a pinned
  host-to-device copy of every tensor; target: <= 3x that copy;
- ``cudaHostRegister`` of a pool-sized map (what page-locking the pool in the
  restoring process would cost; information for the bounce-buffer design);
- with ``--sweep``: the two restores again under other copy settings
  (``CKPTD_H2D_THREADS``, ``CKPTD_H2D_PIECE``, ``CKPTD_H2D_SCRATCH=1``: atomic
  through device memory beside the target, ``CKPTD_H2D_ONE_PASS=0``: ``atomic=False``
  verifying where the bytes lie first, as atomic does), interleaved over several
  passes, each with where its time went (the restore's own phases: pool, plan,
  layout, verify, deliver).

The store is a local directory (``file://``), so no server shares the cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    Table,
    fmt_s,
    fmt_x,
    human_bytes,
    machine,
    make_state,
    parse_size,
    quiet_own_sibling_pools,
    scratch_dir,
    state_nbytes,
    tensors_of,
)

JOB = "bench-gpu"
CHUNK = 4 << 20
# (label, environment) of the --sweep rows; the first is the defaults
TWO_PASSES = {"CKPTD_H2D_ONE_PASS": "0", "CKPTD_H2D_SCRATCH": "0"}
SWEEP: list[tuple[str, dict[str, str]]] = [
    ("defaults", {}),
    ("16 threads", {"CKPTD_H2D_THREADS": "16"}),
    ("12 threads", {"CKPTD_H2D_THREADS": "12"}),
    ("16 threads, 16 MiB pieces", {"CKPTD_H2D_THREADS": "16", "CKPTD_H2D_PIECE": str(16 << 20)}),
    ("atomic through device memory", {"CKPTD_H2D_SCRATCH": "1"}),
    ("blocking events", {"CKPTD_H2D_BLOCKING_EVENTS": "1"}),
    ("blocking events, 12 threads", {"CKPTD_H2D_BLOCKING_EVENTS": "1", "CKPTD_H2D_THREADS": "12"}),
    ("two passes (before)", TWO_PASSES),
    ("two passes, 12 threads", {**TWO_PASSES, "CKPTD_H2D_THREADS": "12"}),
    ("two passes, 16 threads", {**TWO_PASSES, "CKPTD_H2D_THREADS": "16"}),
]


class Phases(logging.Handler):
    """Collects the restore's own debug lines (``restorer``: plan, layout, fetch,
    fill; verified, delivered) as numbers, the last restore's."""

    PATTERN = re.compile(r"(opened in|plan|layout|fetch|fill|verified in|delivered in) ([0-9.]+) s")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for name, value in self.PATTERN.findall(record.getMessage()):
            self.last[{"opened in": "pool"}.get(name, name.removesuffix(" in"))] = float(value)

    def __enter__(self) -> Phases:
        self.last = {}
        log = logging.getLogger("ckptd.client.restore.restorer")
        log.setLevel(logging.DEBUG)
        log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("ckptd.client.restore.restorer").removeHandler(self)


def on_device(state: Any, device: str) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: on_device(v, device) for k, v in state.items()}
    return state


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Floors:
    """Pinned host buffers shaped like the state's tensors: the floors' far side."""

    def __init__(self, state: Any, device: str) -> None:
        self.device = device
        self.dev = tensors_of(state)
        pin = device.startswith("cuda")
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in self.dev]
        self.d2h()  # touched, and the pinned memory allocated

    def d2h(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for h, d in zip(self.host, self.dev, strict=True):
            h.copy_(d, non_blocking=True)
        sync(self.device)
        return time.perf_counter() - t0

    def h2d(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for d, h in zip(self.dev, self.host, strict=True):
            d.copy_(h, non_blocking=True)
        sync(self.device)
        return time.perf_counter() - t0


def host_register_seconds(nbytes: int) -> float | None:
    """cudaHostRegister (and unregister) of a fresh shared map of ``nbytes``."""
    if not torch.cuda.is_available():
        return None
    import mmap

    from ckptd.client import cuda

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    view = torch.frombuffer(mm, dtype=torch.uint8)
    view.fill_(1)  # populated, as a pool is
    t0 = time.perf_counter()
    ok = cuda.pin(view.data_ptr(), nbytes)
    seconds = time.perf_counter() - t0
    if ok:
        cuda.unpin(view.data_ptr())
    del view
    mm.close()
    return seconds if ok else None


def run(size: int, rounds: int, device: str, parent: str | None,
        sweep: list[str] | None = None, sweep_rounds: int = 2) -> tuple[list[Table], list[Any]]:
    from ckptd.client import Checkpointer

    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    with scratch_dir(parent, "ckptd-gpu-") as scratch:
        info = machine(scratch)
        url = f"file://{scratch / 'store'}"
        state = on_device(make_state(size), device)
        nbytes = state_nbytes(state)
        floors = Floors(state, device)
        expected = [t.cpu() for t in tensors_of(state)]
        with Checkpointer(url, JOB, chunk_size=CHUNK, serve_peers=False,
                          shm_dir=os.environ.get("CKPTD_SHM_DIR")) as saver:
            saver.save(0, state).wait(timeout=1800)  # warms the pool (and pins it)
            for rnd in range(rounds):
                # (The same bytes each round: the stall is the staging copy whatever
                # the store holds, and the store stays one state's size on the disk.)
                add("d2h", floors.d2h())
                sync(device)
                t0 = time.perf_counter()
                handle = saver.save(rnd + 1, state)
                handle.staged(timeout=600)
                sync(device)
                add("stall", time.perf_counter() - t0)
                handle.wait(timeout=1800)
                expected = [t.cpu() for t in tensors_of(state)]
                step = rnd + 1
                for atomic in (True, False):
                    add("h2d", floors.h2d())
                    seconds, _ = restore_once(url, state, expected, step, atomic, device)
                    add("restore" if atomic else "restore in-place", seconds)
                print(f"round {rnd + 1}/{rounds}: " + ", ".join(
                    f"{k} {fmt_s(v[-1])}" for k, v in samples.items()), file=sys.stderr,
                    flush=True)
            # Interleaved: every setting once per pass, so that a machine whose memory
            # slows for a while slows them all alike.
            chosen = [(label, env) for label, env in SWEEP if sweep is not None and
                      (not sweep or label in sweep)]
            runs: dict[tuple[str, str], list[tuple[float, dict[str, float]]]] = {}
            for _ in range(sweep_rounds if chosen else 0):
                for label, env in chosen:
                    for atomic in (True, False):
                        with environment(env):
                            seconds, phase = restore_once(url, state, expected, step, atomic,
                                                          device)
                        kind = "atomic" if atomic else "atomic=False"
                        runs.setdefault((label, kind), []).append((seconds, phase))
                        print(f"sweep {label}, {kind}: {fmt_s(seconds)} {phase}",
                              file=sys.stderr, flush=True)
        register = host_register_seconds(nbytes) if device.startswith("cuda") else None

    med = {k: statistics.median(v) for k, v in samples.items()}
    table = Table(f"GPU rows ({human_bytes(nbytes)} on {device}, median of {rounds})",
                  ["row", "time", "GB/s", "floor", "ratio", "target", "met"])

    def row(name: str, key: str, floor: str, most: float | None, target: str) -> None:
        t, f = med[key], med[floor]
        x = t / f if f else float("nan")
        table.add(name, fmt_s(t), f"{nbytes / t / 1e9:.1f}", fmt_s(f), fmt_x(x), target,
                  "-" if most is None else ("yes" if x <= most else "NO"))

    row("pinned device-to-host copy (floor)", "d2h", "d2h", None, "")
    row("ckptd save() stall, warm pool", "stall", "d2h", 1.2, "<= 1.2x the D2H copy")
    row("pinned host-to-device copy (floor)", "h2d", "h2d", None, "")
    row("ckptd restore, local tier -> device", "restore", "h2d", 3.0,
        "<= 3x the H2D copy")
    row("ckptd restore, local tier -> device, atomic=False", "restore in-place", "h2d", 3.0,
        "<= 3x the H2D copy")
    if register is not None:
        table.add("cudaHostRegister of a pool-sized map", fmt_s(register),
                  f"{nbytes / register / 1e9:.1f}", "-", "-", "information", "-")
    table.note("Every ckptd row hashes every chunk (blake3) and is checked bitwise. The "
               "restore reads the pool through its own mapping (a restarted process's: not "
               "page-locked), copies each chunk into page-locked bounce buffers and on to "
               "the device on several threads and streams.")
    tables = [table]
    if runs:
        h2d = med["h2d"]
        n = len(next(iter(runs.values())))
        more = Table(f"Restore settings, local tier -> {device} ({human_bytes(nbytes)}, "
                     f"{n} interleaved passes: median, fastest; phases of the median one)",
                     ["settings", "restore", "median", "vs H2D", "fastest", "pool open",
                      "pool + plan", "layout", "verify", "deliver"])
        for (label, kind), got in runs.items():
            ordered = sorted(got, key=lambda r: r[0])
            t, phase = ordered[(len(ordered) - 1) // 2]
            more.add(label, kind, fmt_s(t), fmt_x(t / h2d) if h2d else "-",
                     fmt_s(ordered[0][0]),
                     *(fmt_s(phase[k]) if k in phase else "-"
                       for k in ("pool", "plan", "layout", "verified", "delivered")))
        more.note("Settings: CKPTD_H2D_THREADS (copying threads per device), CKPTD_H2D_PIECE "
                  "(bounce buffer), CKPTD_H2D_SCRATCH=1 (atomic: sent and hashed into "
                  "device memory beside the target, then copied into it; by default every "
                  "chunk is hashed where it lies, then sent), CKPTD_H2D_ONE_PASS=0 "
                  "(atomic=False verifies first too: the code before). Nothing reaches an "
                  "atomic restore's target before every chunk verified. 'pool + plan': "
                  "from the restore's start to its plan (the pool's opening included).")
        tables.append(more)
    return tables, info


class environment:  # noqa: N801  (a context manager read as a phrase)
    """Sets environment variables for a block, restoring them after."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def restore_once(url: str, state: Any, expected: list[torch.Tensor], step: int, atomic: bool,
                 device: str) -> tuple[float, dict[str, float]]:
    """One restore of ``step`` from the local tier into zeroed tensors on ``device``,
    checked bitwise: its seconds and its phases."""
    from ckptd.client import Checkpointer

    target = on_device({k: v for k, v in state.items()}, device)
    for t in tensors_of(target):
        t.zero_()
    with Checkpointer(url, JOB, serve_peers=False,
                      shm_dir=os.environ.get("CKPTD_SHM_DIR")) as reader, Phases() as phases:
        sync(device)
        t0 = time.perf_counter()
        result = reader.restore(target, step=step, tiers=("local",), atomic=atomic)
        sync(device)
        seconds = time.perf_counter() - t0
    assert result.bytes_from.get("local") == result.bytes_fetched, result
    got = tensors_of(target)
    assert all(torch.equal(g.cpu().view(-1).view(torch.uint8), e.view(-1).view(torch.uint8))
               for g, e in zip(got, expected, strict=True)), "bitwise"
    return seconds, dict(phases.last)




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4G", help="state size (default 4G)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (default), cuda:N, or cpu (the harness itself)")
    parser.add_argument("--scratch", default=None,
                        help="parent of the scratch directory (the store)")
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    parser.add_argument("--sweep", nargs="*", default=None, metavar="LABEL",
                        help="the restores again under other copy settings (all, or those "
                             "named), with phases")
    parser.add_argument("--sweep-rounds", type=int, default=2,
                        help="interleaved passes over the settings")
    args = parser.parse_args()
    quiet_own_sibling_pools()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        # Non-zero: bench/device.sh and gpu.sh count a step that measured nothing as failed.
        sys.exit("bench.gpu: no CUDA device here; nothing measured (--device cpu runs the "
                 "harness on the CPU)")
    tables, info = run(parse_size(args.size), args.rounds, args.device, args.scratch,
                       args.sweep, args.sweep_rounds)
    for table in tables:
        table.print()
    if args.markdown:
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info]
        Path(args.markdown).write_text("\n".join(t.markdown() for t in tables) + "\n"
                                       + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
