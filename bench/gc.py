"""Garbage collection benchmark: a store of 100 steps with 10% of chunks changing per
step, all but the last 10 forgotten; GC time and bytes freed (against a plain unlink
of the same files, measured in the same run), and the save stall and commit time while
GC runs, as ratios to the same saves without GC (ckptd's design target: <= 1.1x).

    python -m bench.gc                    # 16 MiB state, 100 steps, 64 KiB chunks
    python -m bench.gc --size 8M --steps 40 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import KiB, human_bytes, make_state, parse_size, tensors_of

JOB = "gcbench"
KEEP = 10  # steps the measured collection keeps; it collects the rest


def edit_fraction(state: Any, chunk_size: int, fraction: float, rng: random.Random) -> int:
    """Changes one byte in ``fraction`` of every tensor's chunks; returns chunks changed."""
    changed = 0
    for t in tensors_of(state):
        flat = t.detach().view(-1).view(torch.uint8)
        n = (flat.numel() + chunk_size - 1) // chunk_size
        for i in rng.sample(range(n), max(1, round(n * fraction))):
            flat[i * chunk_size] += 1
            changed += 1
    return changed


def dir_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs]


_GC_LOOP = """
import asyncio, sys
from ckptd.errors import GcInProgress
from ckptd.lifecycle.gc import collect_garbage
from ckptd.lifecycle.retention import RetentionPolicy, forget
from ckptd.repository import Repository
from ckptd.store import LocalStore

async def loop():
    repo = Repository(LocalStore(sys.argv[1]))
    runs = 0
    while True:
        await forget(repo, sys.argv[3], RetentionPolicy(keep_last=5))
        try:
            await collect_garbage(repo.store, grace=float(sys.argv[2]), lease=2.0)
        except GcInProgress:  # the previous round's collector was stopped mid-way
            await asyncio.sleep(0.2)
            continue
        runs += 1
        print(runs, flush=True)

asyncio.run(loop())
"""


class GcLoop:
    """Forget all but the last steps and collect, back to back, in another process
    (as the server's background task would: never inside the training process)."""

    def __init__(self, root: Path, grace: float) -> None:
        self.args = [sys.executable, "-c", _GC_LOOP, str(root), str(grace), JOB]
        self.runs = 0
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> GcLoop:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # one collection done: it is running, imports paid
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        self.proc.terminate()
        out, _ = self.proc.communicate()
        self.runs = 1 + len(out.split())


_BUSY = """
import blake3, sys
data = bytes(1 << 20)
print(1, flush=True)
while True:
    blake3.blake3(data).digest()
"""


class BusyLoop(GcLoop):
    """A peer for the GC process: one process that only burns a core (hashing),
    to tell what a collector costs from what any busy neighbour costs on 2 cores."""

    def __init__(self) -> None:
        self.args = [sys.executable, "-c", _BUSY]
        self.runs = 0
        self.proc = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="16M", help="state size (16M)")
    ap.add_argument("--steps", type=int, default=100,
                    help=f"steps in the store (100); GC collects all but the last {KEEP}")
    ap.add_argument("--chunk", default="64K", help="chunk size (64K)")
    ap.add_argument("--fraction", type=float, default=0.10,
                    help="fraction of each tensor's chunks changed per step (0.10)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of saves with/without GC")
    ap.add_argument("--saves", type=int, default=8, help="saves per round")
    ap.add_argument("--grace", type=float, default=0.5, help="GC grace in the GC-while-saving "
                    "rounds (seconds; a real server uses the longest save, 600 s)")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (a temporary "
                    "directory by default)")
    args = ap.parse_args()
    if args.steps <= KEEP:
        sys.exit(f"bench.gc: --steps {args.steps} leaves nothing to collect (GC keeps the "
                 f"last {KEEP} steps): give more than {KEEP}")
    nbytes, chunk = parse_size(args.size), parse_size(args.chunk)

    from ckptd.client import Checkpointer
    from ckptd.lifecycle.gc import collect_garbage
    from ckptd.lifecycle.retention import RetentionPolicy, forget
    from ckptd.repository import Repository
    from ckptd.store import LocalStore

    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-gc-", dir=args.dir) as scratch:
        root = Path(scratch) / "store"
        state = make_state(nbytes, seed=5)
        ckpt = Checkpointer(f"file://{root}", JOB, chunk_size=chunk)
        step = 0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step += 1
            if step > 1:
                edit_fraction(state, chunk, args.fraction, rng)
            assert ckpt.save(step, state).wait().state == "committed"
        build = time.perf_counter() - t0
        store_bytes = sum(p.stat().st_size for p in dir_files(root / "chunks"))
        print(f"store: {args.steps} steps of {human_bytes(nbytes)}, {args.fraction:.0%} of "
              f"{chunk // KiB} KiB chunks changing per step: {human_bytes(store_bytes)} of "
              f"chunks, built in {build:.1f} s")

        async def forget_and_collect(dry: bool) -> Any:
            repo = Repository(LocalStore(root))
            if not dry:
                await forget(repo, JOB, RetentionPolicy(keep_last=KEEP))
            return await collect_garbage(repo.store, grace=0.0, dry_run=dry)

        # The floor: unlinking the same files, in a copy of the doomed set.
        asyncio.run(forget(Repository(LocalStore(root)), JOB, RetentionPolicy(keep_last=KEEP),
                           dry_run=False))
        plan = asyncio.run(forget_and_collect(True))
        floor_dir = Path(scratch) / "floor"
        floor_dir.mkdir()
        for cid in plan.deleted:
            with open(floor_dir / cid, "wb") as f:
                f.write(b"\0" * 1)
        os.sync()
        t0 = time.perf_counter()
        for p in dir_files(floor_dir):
            p.unlink()
        unlink_s = time.perf_counter() - t0
        os.sync()
        # A second peer: one torch.save + fsync of the state, to the same disk.
        t0 = time.perf_counter()
        with open(Path(scratch) / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        torch_save_s = time.perf_counter() - t0
        report = asyncio.run(forget_and_collect(False))
        print(f"\n| GC of {args.steps - KEEP} forgotten steps | value |\n| --- | --- |")
        print(f"| time | {report.seconds:.3f} s |")
        print(f"| bytes freed | {human_bytes(report.bytes_freed)} "
              f"({report.bytes_freed / max(1, report.bytes_total):.0%} of the chunks) |")
        print(f"| chunks deleted / kept | {report.chunks_deleted} / {report.chunks_kept} |")
        print(f"| manifests read | {report.manifests_read} |")
        print(f"| time / serial unlink of {len(plan.deleted)} files (floor-ish; GC deletes "
              f"16 at a time) | {report.seconds / max(unlink_s, 1e-9):.2f}x |")
        print(f"| time / one torch.save + fsync of the {human_bytes(nbytes)} state | "
              f"{report.seconds / max(torch_save_s, 1e-9):.2f}x |")

        # Saves with and without a GC running, alternating rounds.
        modes = ["without GC", "with GC", "with a busy process"]
        results: dict[str, dict[str, list[float]]] = {
            k: {"stall": [], "commit": []} for k in modes}
        gc_runs = 0
        for r in range(args.rounds):
            for mode in modes[r % 3:] + modes[:r % 3]:
                loop: GcLoop | None = (GcLoop(root, args.grace) if mode == "with GC" else
                                       BusyLoop() if mode == "with a busy process" else None)
                if loop is not None:
                    loop.__enter__()
                try:
                    for _ in range(args.saves):
                        step += 1
                        edit_fraction(state, chunk, args.fraction, rng)
                        t0 = time.perf_counter()
                        h = ckpt.save(step, state)
                        stall = time.perf_counter() - t0
                        assert h.wait().state == "committed"
                        results[mode]["stall"].append(stall)
                        results[mode]["commit"].append(time.perf_counter() - t0)
                finally:
                    if loop is not None:
                        loop.__exit__()
                        gc_runs += loop.runs if mode == "with GC" else 0
        ckpt.close()
        med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in results.items()}
        print(f"\n| {args.rounds} x {args.saves} saves, medians | without GC | with GC "
              "| ratio (target <= 1.1x) | with a busy process (peer) | its ratio |"
              "\n| --- | --- | --- | --- | --- | --- |")
        for k, what in (("stall", "save() stall"), ("commit", "save to committed")):
            a, b, c = (med[m][k] for m in modes)
            print(f"| {what} | {a * 1000:.1f} ms | {b * 1000:.1f} ms | {b / a:.2f}x "
                  f"| {c * 1000:.1f} ms | {c / a:.2f}x |")
        print(f"\n{gc_runs} GC runs overlapped the 'with GC' saves (grace {args.grace} s, "
              f"each forgets all but the last 5 steps).")


if __name__ == "__main__":
    main()
