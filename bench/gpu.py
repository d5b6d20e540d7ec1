"""The GPU rows (issue 21, item 6): a rank's state on a CUDA device, staged by
``save()`` and restored from the local tier, each beside its floor measured in the
same run on the same bytes.

    python -m bench.gpu                       # 4 GiB on cuda:0, 3 rounds
    python -m bench.gpu --size 1G --rounds 5
    python -m bench.gpu --device cpu --size 64M   # the harness itself, on the CPU

Rows:

- ``save()`` stall (``save()`` then ``staged()``: until the tensors may change)
  into a warm staging pool, against a pinned device-to-host copy of every tensor
  (one synchronize at the end): DESIGN.md "stall of save() <= 1.2 x one plain
  copy of the state";
- restore from the local tier (this rank's pool in /dev/shm, as a restarted
  process finds it: not page-locked in the restoring process) into the
  existing CUDA tensors, atomic and ``atomic=False``, against a pinned
  host-to-device copy of every tensor: "<= 3 x the pinned host-to-device copy";
- ``cudaHostRegister`` of a pool-sized map (what page-locking the pool in the
  restoring process would cost; information for the bounce-buffer design).

The store is a local directory (``file://``), so no server shares the cores.
"""

from __future__ import annotations

import argparse
import os
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
    scratch_dir,
    state_nbytes,
    tensors_of,
)

JOB = "bench-gpu"
CHUNK = 4 << 20


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


def run(size: int, rounds: int, device: str, parent: str | None) -> tuple[Table, list[Any]]:
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
                    target = on_device({k: v for k, v in state.items()}, device)
                    for t in tensors_of(target):
                        t.zero_()
                    add("h2d", floors.h2d())
                    with Checkpointer(url, JOB, serve_peers=False,
                                      shm_dir=os.environ.get("CKPTD_SHM_DIR")) as reader:
                        sync(device)
                        t0 = time.perf_counter()
                        result = reader.restore(target, step=step, tiers=("local",),
                                                atomic=atomic)
                        sync(device)
                        add("restore" if atomic else "restore in-place",
                            time.perf_counter() - t0)
                    assert result.bytes_from.get("local") == result.bytes_fetched, result
                    got = tensors_of(target)
                    assert all(torch.equal(g.cpu().view(-1).view(torch.uint8),
                                           e.view(-1).view(torch.uint8))
                               for g, e in zip(got, expected, strict=True)), "bitwise"
                    del target, got
                print(f"round {rnd + 1}/{rounds}: " + ", ".join(
                    f"{k} {fmt_s(v[-1])}" for k, v in samples.items()), file=sys.stderr,
                    flush=True)
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
    return table, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; nothing measured (--device cpu runs the "
              "harness on the CPU)")
        return
    table, info = run(parse_size(args.size), args.rounds, args.device, args.scratch)
    table.print()
    if args.markdown:
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info]
        Path(args.markdown).write_text(table.markdown() + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
