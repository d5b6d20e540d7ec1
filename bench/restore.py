"""Restore benchmark: one rank restores its state from local shared memory, from
peers, from the server's store, and ``torch.load``s the same state from local
disk, side by side in one run.

    python -m bench.restore                 # 1 GiB, 3 rounds
    python -m bench.restore --size 256M --rounds 2
    python -m bench.restore --markdown out.md

Set-up: a ``ckptd serve`` process over a local directory store; three
data-parallel ranks save the same state (rank 0 in this process, ranks 1 and 2 in
two peer processes that then keep serving their staging pools). Each round then
restores rank 0's state into a target that already holds tensors of the right
shapes (a constructed model and optimizer), with a fresh ``Checkpointer`` and one
tier allowed at a time:

- ``local shm``: rank 0's staging pool in /dev/shm (what a restarted worker finds),
  atomic, and with ``atomic=False`` (each chunk copied into the target and hashed
  there in one pass, where an atomic restore hashes all, then copies),
- ``peers``: ranks 1 and 2's pools over loopback HTTP, in parallel (atomic, and
  with ``atomic=False``: straight into the target),
- ``store``: the server (chunks read from its directory store over HTTP), and the
  same directory read by the client itself (``file://``: the store tier, warm),
- ``copy_``: a plain copy of the state into the target (the local tier's floor),
- ``torch.load``: the same state ``torch.save``d to the scratch directory, loaded
  back (page cache warm: its best case), and the same plus the copy into the
  target that ``load_state_dict`` would do;
- cold cache: the ``file://`` store tier (atomic, and ``atomic=False``),
  ``torch.load`` and a plain read of the store's chunk files (the floor), each
  after the files' pages are dropped from the page cache
  (``posix_fadvise(DONTNEED)``; clean pages only, so no root needed);
- ``dcp.load``: the same state through ckptd's DCP ``Reader`` (over HTTP and over
  ``file://``) against DCP's own ``FileSystemReader`` of a ``dcp.save`` directory;
- with CUDA: the local tier into CUDA tensors against the pinned host-to-device
  copy of the same bytes (the floor).

Every ckptd restore hash-checks every chunk; ``torch.load`` checks nothing. The
order of the systems rotates from round to round; the table shows medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.common import (
    GiB,
    Samples,
    Server,
    Table,
    fmt_gbps,
    fmt_s,
    fmt_x,
    fsync_dir,
    human_bytes,
    machine,
    make_state,
    parse_size,
    quiesce,
    quiet_own_sibling_pools,
    ratio,
    release_free_memory,
    rotated,
    scratch_dir,
    size_label,
    state_nbytes,
    tensors_of,
)

JOB = "bench-restore"
DCP_JOB = "bench-restore-dcp"
STEP = 1
WORLD = 3
CHUNK = 4 << 20


def zeros_like(state: Any) -> Any:
    """A target shaped like ``state``, every page touched (a constructed model)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return state


def replacement_target(state: Any) -> Any:
    """What a replacement rank restores into: a constructed model (every page
    touched) and a fresh optimizer, whose moments do not exist yet."""
    optim = state["optim"]
    return {"model": zeros_like(state["model"]),
            "optim": {"state": {}, "param_groups": deepcopy(optim["param_groups"])},
            "step": 0}


def same_bits(a: Any, b: Any) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb, strict=True)
    )


def drop_cached(paths: list[Path]) -> None:
    """Drops the files' clean pages from the page cache: the next read goes to disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def raw_read(paths: list[Path], block: int = 8 << 20) -> int:
    """Reads every byte of ``paths`` with large reads into one reused buffer."""
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def cuda_target(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state, device="cuda")
    if isinstance(state, dict):
        return {k: cuda_target(v) for k, v in state.items()}
    if isinstance(state, list):
        return [cuda_target(v) for v in state]
    return state


def pinned_h2d(state: Any) -> Any:
    """The floor of a restore into CUDA tensors: pinned host memory to the device,
    every tensor of the state, non-blocking, one synchronize at the end. Returns a
    callable that times one such copy."""
    src = [t.pin_memory() for t in tensors_of(state)]
    dst = [torch.empty_like(t, device="cuda") for t in src]

    def copy() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, h in zip(dst, src, strict=True):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return copy


def peer_main(url: str, rank: int, size: int) -> None:
    """A peer rank: saves the state, drops its own copy, serves its pool."""
    from ckptd.client import Checkpointer

    state = make_state(size)
    ckpt = Checkpointer(url, JOB, rank=rank, world_size=WORLD, chunk_size=CHUNK,
                        heartbeat_interval=0.5)
    ckpt.save(STEP, state).wait(timeout=600)
    del state
    release_free_memory()
    print("READY", flush=True)
    while True:
        time.sleep(3600)


def wait_peers(url: str, ranks: list[int], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = httpx.get(f"{url}/v1/jobs/{JOB}/ranks", timeout=10)
        if resp.status_code == 200:
            held = {r["rank"]: r["held_step"] for r in resp.json()["ranks"]}
            if all(held.get(r) == STEP for r in ranks):
                return
        time.sleep(0.2)
    raise RuntimeError(f"peers {ranks} never held step {STEP}")


def run(size: int, rounds: int, parent: str | None,
        only: str | None = None) -> tuple[list[Table], list[tuple[str, str]]]:
    from ckptd.client import Checkpointer

    # ``--only dcp``: the dcp.load rows alone (no peers, no Checkpointer save), for
    # quick iterations on the DCP Reader; their ratios are still in one run.
    # ``--only cuda``: the local tier into CUDA tensors and its floor (bench/gpu.sh).
    dcp_only = only == "dcp"
    cuda_only = only == "cuda"
    if cuda_only and not torch.cuda.is_available():
        raise SystemExit("bench.restore --only cuda: no CUDA device here; nothing measured")

    with scratch_dir(parent) as scratch:
        info = machine(scratch)
        os.environ.setdefault("CKPTD_HEARTBEAT_INTERVAL", "0.5")
        with Server(scratch / "store", scratch / "server.log") as server:
            state = make_state(size)
            nbytes = state_nbytes(state)
            peers = [] if dcp_only or cuda_only else [subprocess.Popen(
                [sys.executable, "-m", "bench.restore", "--peer", server.url, str(r),
                 str(size)], stdout=subprocess.PIPE, text=True) for r in (1, 2)]
            # Without peer processes rank 0 is the whole job: a step of WORLD ranks with
            # one saved never commits, and the local tier restores only committed steps.
            world = WORLD if peers else 1
            try:
                owner = Checkpointer(server.url, JOB, rank=0, world_size=world, chunk_size=CHUNK,
                                     serve_peers=False)
                if not dcp_only:
                    owner.save(STEP, state).wait(timeout=600)
                for p in peers:
                    assert p.stdout is not None
                    line = p.stdout.readline()
                    if not line.startswith("READY"):
                        raise RuntimeError("a peer process failed to start")
                if peers:
                    wait_peers(server.url, [1, 2])
                path = scratch / "state.pt"
                if not cuda_only:
                    torch.save(state, path)
                    with open(path, "rb+") as f:
                        os.fsync(f.fileno())
                    fsync_dir(scratch)
                import torch.distributed.checkpoint as dcp

                from ckptd.client.dcp import Reader, Writer

                dcp_dir = scratch / "dcp"
                if not cuda_only:
                    with warnings.catch_warnings():  # (one process: DCP's no_dist mode)
                        warnings.simplefilter("ignore")
                        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir))
                        dcp.save(state, storage_writer=Writer(server.url, DCP_JOB, STEP,
                                                              chunk_size=CHUNK))
                chunk_files = files_under(server.store / "chunks")
                target = zeros_like(state)
                samples = Samples()
                tiers: dict[str, dict[str, int]] = {}

                def restore(system: str) -> float:
                    tier, _, mode = system.partition(" ")
                    # "store file": the same store read as a local directory (file://).
                    # "in-place": atomic=False (verified chunks written straight into the
                    # target, one pass from the pool, a store file or a socket).
                    url = f"file://{server.store}" if "file" in mode.split() else server.url
                    with Checkpointer(url, JOB, rank=0, world_size=world,
                                      serve_peers=False) as ckpt:
                        t0 = time.perf_counter()
                        result = ckpt.restore(target, tiers=(tier,),
                                              atomic="in-place" not in mode.split())
                        seconds = time.perf_counter() - t0
                    tiers[tier] = result.bytes_from
                    assert result.bytes_from.get(tier, 0) == result.bytes_fetched, result
                    assert same_bits(target, state), tier
                    for t in tensors_of(target):  # the next round must restore for real
                        t.view(torch.uint8).zero_() if t.dtype != torch.bool else t.zero_()
                    return seconds

                def restore_fresh(system: str) -> float:
                    """A restore into a replacement rank's state: the optimizer's
                    moments are created (fresh memory, as ``torch.load`` makes)."""
                    tier = system.split()[0]
                    fresh = replacement_target(state)
                    with Checkpointer(server.url, JOB, rank=0, world_size=world,
                                      serve_peers=False) as ckpt:
                        t0 = time.perf_counter()
                        result = ckpt.restore(fresh, tiers=(tier,))
                        seconds = time.perf_counter() - t0
                    assert result.bytes_from.get(tier, 0) == result.bytes_fetched, result
                    assert same_bits(fresh, state), system
                    del fresh
                    return seconds

                def copy() -> float:
                    """The floor of the local tier on the CPU: ``copy_`` of the state."""
                    t0 = time.perf_counter()
                    for dst, src in zip(tensors_of(target), tensors_of(state), strict=True):
                        dst.copy_(src)
                    seconds = time.perf_counter() - t0
                    for t in tensors_of(target):
                        t.view(torch.uint8).zero_() if t.dtype != torch.bool else t.zero_()
                    return seconds

                def cold_store(system: str) -> float:
                    drop_cached(chunk_files)
                    return restore(system.replace(" cold", ""))

                def cold_raw() -> float:
                    drop_cached(chunk_files)
                    t0 = time.perf_counter()
                    raw_read(chunk_files)
                    return time.perf_counter() - t0

                def cold_load() -> float:
                    drop_cached([path])
                    return load()[0]

                def dcp_load(system: str) -> float:
                    reader: Any
                    if system == "dcp.load fs":
                        reader = dcp.FileSystemReader(dcp_dir)
                    else:
                        url = f"file://{server.store}" if system.endswith("file") else server.url
                        reader = Reader(url, DCP_JOB, STEP)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        t0 = time.perf_counter()
                        dcp.load(target, storage_reader=reader)
                        seconds = time.perf_counter() - t0
                    assert same_bits(target, state), system
                    for t in tensors_of(target):
                        t.view(torch.uint8).zero_() if t.dtype != torch.bool else t.zero_()
                    return seconds

                h2d = pinned_h2d(state) if torch.cuda.is_available() else None
                gpu_target = cuda_target(state) if h2d is not None else None

                def restore_cuda() -> float:
                    assert gpu_target is not None
                    with Checkpointer(server.url, JOB, rank=0, world_size=world,
                                      serve_peers=False) as ckpt:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        ckpt.restore(gpu_target, tiers=("local",))
                        torch.cuda.synchronize()
                        seconds = time.perf_counter() - t0
                    assert same_bits([t.cpu() for t in tensors_of(gpu_target)],
                                     tensors_of(state)), "cuda"
                    for t in tensors_of(gpu_target):
                        t.view(torch.uint8).zero_() if t.dtype != torch.bool else t.zero_()
                    return seconds

                def load() -> tuple[float, float]:
                    t0 = time.perf_counter()
                    loaded = torch.load(path)
                    t1 = time.perf_counter()
                    for dst, src in zip(tensors_of(target), tensors_of(loaded), strict=True):
                        dst.copy_(src)
                    t2 = time.perf_counter()
                    assert same_bits(target, state)
                    del loaded
                    return t1 - t0, t2 - t0

                systems = ["local", "local in-place", "local fresh", "peer", "peer in-place",
                           "peer fresh", "store",
                           "store file", "copy_", "torch.load", "store file cold",
                           "store file cold in-place", "raw read cold", "torch.load cold",
                           "dcp.load http", "dcp.load file", "dcp.load fs"]
                if h2d is not None:
                    systems += ["local cuda", "h2d pinned"]
                if dcp_only:
                    systems = [s for s in systems if s.startswith("dcp.load")]
                if cuda_only:
                    systems = ["local cuda", "h2d pinned", "local", "copy_"]
                for rnd in range(rounds):
                    for system in rotated(systems, rnd):
                        quiesce()
                        release_free_memory()
                        if system == "copy_":
                            samples.add("copy_", "s", copy())
                        elif system == "torch.load":
                            plain, copied = load()
                            samples.add("torch.load", "s", plain)
                            samples.add("torch.load + copy", "s", copied)
                        elif system.startswith("store file cold"):
                            samples.add(system, "s", cold_store(system))
                        elif system == "raw read cold":
                            samples.add(system, "s", cold_raw())
                        elif system == "torch.load cold":
                            samples.add(system, "s", cold_load())
                        elif system.startswith("dcp.load"):
                            samples.add(system, "s", dcp_load(system))
                        elif system.endswith(" fresh"):
                            samples.add(system, "s", restore_fresh(system))
                        elif system == "local cuda":
                            samples.add(system, "s", restore_cuda())
                        elif system == "h2d pinned":
                            assert h2d is not None
                            samples.add(system, "s", h2d())
                        else:
                            samples.add(system, "s", restore(system))
                    print(f"round {rnd + 1}/{rounds}: " + ", ".join(
                        f"{k} {fmt_s(samples.values[k]['s'][-1])}" for k in samples.values),
                        flush=True)
                owner.close()
            finally:
                for p in peers:
                    p.kill()
                    p.wait()
                # Killed peers leave their pools in /dev/shm, as a crash would.
                from ckptd.client.staging.reader import remove_stale_pools

                remove_stale_pools(job=JOB)

    if dcp_only or cuda_only:
        return [targets_table(samples, nbytes, rounds)], info
    base = samples.median("torch.load", "s")
    base_copy = samples.median("torch.load + copy", "s")
    table = Table(
        f"Restore of {size_label(size)} ({human_bytes(nbytes)}) into an existing state, one rank, "
        f"median of {rounds}",
        ["source", "time", "GB/s", "vs torch.load", "vs torch.load + copy", "vs copy_", "range"],
    )
    names = {"local": "ckptd, local shared memory",
             "local in-place": "ckptd, local shared memory, atomic=False",
             "local fresh": "ckptd, local shared memory, into a fresh optimizer",
             "peer fresh": "ckptd, 2 peers, into a fresh optimizer",
             "peer": "ckptd, 2 peers (loopback HTTP)",
             "peer in-place": "ckptd, 2 peers, atomic=False",
             "store": "ckptd, server store (HTTP)",
             "store file": "ckptd, store as a local directory (file://)",
             "copy_": "copy_ of the state (local tier floor)",
             "torch.load": "torch.load, local disk",
             "torch.load + copy": "torch.load + copy into the state"}
    base_floor = samples.median("copy_", "s")
    for system in ("local", "local in-place", "local fresh", "peer", "peer in-place",
                   "peer fresh", "store", "store file",
                   "copy_", "torch.load", "torch.load + copy"):
        t = samples.median(system, "s")
        table.add(names[system], fmt_s(t), fmt_gbps(nbytes, t), fmt_x(ratio(t, base)),
                  fmt_x(ratio(t, base_copy)), fmt_x(ratio(t, base_floor)),
                  samples.spread(system, "s"))
    table.note("ckptd hash-checks every chunk (blake3) and fills the state in place; "
               "torch.load checks nothing and allocates fresh tensors. Ratios below 1 are "
               "faster than torch.load. Page cache warm for torch.load and the store. "
               "atomic=False: chunks land in the state's tensors as they verify "
               "(from peers: no landing memory; from the pool or a file: copied and hashed "
               "in one pass, not hashed and then copied; a failed restore leaves the state "
               "partly restored). A fresh optimizer: the target a replacement rank "
               "holds (a constructed model, an optimizer with no moments yet), which the "
               "restore creates, as torch.load creates every tensor. The peers are two "
               "processes on the same cores as the restoring rank: their serving CPU "
               "competes with it here, not across nodes.")
    return [table, targets_table(samples, nbytes, rounds)], info


# The issue-11 targets: (row, its floor or peer, the most the ratio may be).
TARGETS = [
    ("local", "copy_", 2.0, "local tier on the CPU <= 2x copy_"),
    ("local in-place", "copy_", 2.0, "local tier, atomic=False <= 2x copy_"),
    ("store file", "torch.load", 0.7, "store tier (file://), warm <= 0.7x torch.load"),
    ("store file cold", "raw read cold", 1.1, "store tier (file://), cold <= 1.1x a raw read"),
    ("store file cold in-place", "raw read cold", 1.1,
     "store tier (file://), cold, atomic=False <= 1.1x a raw read"),
    ("peer", "torch.load", 0.8, "peers over loopback <= 0.8x torch.load"),
    ("peer in-place", "torch.load", 0.8, "peers, atomic=False <= 0.8x torch.load"),
    ("store", "torch.load", 1.0, "store tier over HTTP <= 1.0x torch.load"),
    ("dcp.load http", "dcp.load fs", 1.0, "dcp.load via Reader (HTTP) <= 1.0x FileSystemReader"),
    ("dcp.load file", "dcp.load fs", 1.0, "dcp.load via Reader (file://) <= 1.0x FileSystemReader"),
    ("local cuda", "h2d pinned", 3.0, "local tier into CUDA <= 3x pinned H2D copy"),
]


def targets_table(samples: Samples, nbytes: int, rounds: int) -> Table:
    """Each target of issue 11 as a ratio to its floor or peer in the same run."""
    table = Table(f"Restore targets ({human_bytes(nbytes)}, medians of {rounds})",
                  ["target", "ckptd", "floor / peer", "ratio", "met"])
    for row, base, most, label in TARGETS:
        if row not in samples.values or base not in samples.values:
            if "cuda" in row:
                table.add(label, "-", "-", "-", "not measured (no CUDA)")
            continue  # (another row left out by --only)
        t, b = samples.median(row, "s"), samples.median(base, "s")
        x = ratio(t, b)
        table.add(label, fmt_s(t), fmt_s(b), fmt_x(x), "yes" if x <= most else "NO")
    table.note("cold: the files' pages dropped with posix_fadvise(DONTNEED) before each run; "
               "a raw read is one pass of 8 MiB reads over the store's chunk files. "
               "dcp.load loads into the same existing state through each reader.")
    return table


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        peer_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="state size (default 1G)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="parent of the scratch directory")
    parser.add_argument("--markdown", default=None, help="write the tables to this file")
    parser.add_argument("--only", choices=["dcp", "cuda"], default=None,
                        help="run only these rows (dcp: the dcp.load rows; cuda: the local "
                        "tier into CUDA tensors and its floors)")
    args = parser.parse_args()
    quiet_own_sibling_pools()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gc.collect()
    size = parse_size(args.size)
    if size > 8 * GiB:
        parser.error("sizes above 8 GiB need more memory than this benchmark plans for")
    tables, info = run(size, args.rounds, args.scratch, args.only)
    for table in tables:
        table.print()
    if args.markdown:
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info]
        Path(args.markdown).write_text("\n".join(t.markdown() for t in tables) + "\n"
                                       + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
