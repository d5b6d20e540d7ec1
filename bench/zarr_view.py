"""zarr view: one 1% slice of a large tensor against restoring the whole step, and
``ckptd export --zarr`` throughput against ``dcp.save`` of the same state.

    python -m bench.zarr_view [--size 1G] [--rounds 3] [--markdown FILE]

One fp32 tensor of ``--size`` bytes (square-ish, rows of 64 KiB at 1 GiB) is saved
as one step by a real ``ckptd serve``. Each round, in rotated order: a fresh
``CheckpointStore`` opens the step and reads 1% of the rows (``arr[r0:r1, :]``:
commit record, manifest and only the chunks under those rows, each verified); a
``Checkpointer.restore`` of the whole step from the store tier into an existing
tensor; the same two over ``file://``; ``export_step`` of the step to a new
directory (no codec, then zstd); ``dcp.save`` of the in-memory state to a new
directory (FileSystemWriter, sync_files off: neither side fsyncs).
Targets: slice <= 0.05 x the whole-step restore (issue 14).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import time
from pathlib import Path

import torch

from bench.common import (
    GiB,
    Samples,
    Server,
    Table,
    fmt_gbps,
    fmt_s,
    fmt_x,
    human_bytes,
    machine,
    parse_size,
    quiesce,
    ratio,
    rotated,
    scratch_dir,
    size_label,
)

JOB = "zarrbench"
STEP = 1


def run(size: int, rounds: int, parent: str | None) -> tuple[list[Table], list[tuple[str, str]]]:
    import torch.distributed.checkpoint as dcp
    import zarr

    from ckptd.client import Checkpointer
    from ckptd.client.zarr_export import export_step
    from ckptd.zarr import CheckpointStore

    cols = 16384 if size >= GiB else 4096
    rows = max(100, size // (cols * 4))
    nbytes = rows * cols * 4
    r0 = rows // 3
    r1 = r0 + math.ceil(rows / 100)
    slice_bytes = (r1 - r0) * cols * 4
    with scratch_dir(parent) as scratch:
        info = machine(scratch)
        with Server(scratch / "store", scratch / "server.log") as server:
            state = {"w": torch.randn(rows, cols)}
            with Checkpointer(server.url, JOB, serve_peers=False) as ckpt:
                ckpt.save(STEP, state).wait(timeout=900)
            file_url = f"file://{scratch / 'store'}"
            target = {"w": torch.zeros(rows, cols)}
            expect = state["w"][r0:r1].numpy()
            samples = Samples()
            fetched: dict[str, int] = {}

            def view_slice(url: str) -> float:
                t0 = time.perf_counter()
                store = CheckpointStore(url, JOB, STEP)
                arr = zarr.open_group(store=store, mode="r")["w"]
                got = arr[r0:r1, :]
                seconds = time.perf_counter() - t0
                fetched[url] = store.fetched
                store.close()
                assert (got == expect).all()
                return seconds

            def restore(url: str) -> float:
                with Checkpointer(url, JOB, serve_peers=False) as ckpt:
                    t0 = time.perf_counter()
                    ckpt.restore(target, step=STEP, tiers=("store",))
                    seconds = time.perf_counter() - t0
                assert torch.equal(target["w"], state["w"])
                target["w"].zero_()
                return seconds

            def export(codec: str | None) -> float:
                out = scratch / "export"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                export_step(file_url, JOB, out, STEP, codec=codec)
                seconds = time.perf_counter() - t0
                shutil.rmtree(out)
                return seconds

            def dcp_save() -> float:
                out = scratch / "dcp"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), sync_files=False),
                         no_dist=True)
                seconds = time.perf_counter() - t0
                shutil.rmtree(out)
                return seconds

            systems = {
                "slice http": lambda: view_slice(server.url),
                "restore http": lambda: restore(server.url),
                "slice file": lambda: view_slice(file_url),
                "restore file": lambda: restore(file_url),
                "export": lambda: export(None),
                "export zstd": lambda: export("zstd"),
                "dcp.save": dcp_save,
            }
            for rnd in range(rounds):
                for name in rotated(list(systems), rnd):
                    quiesce()
                    samples.add(name, "s", systems[name]())
                print(f"round {rnd + 1}/{rounds}: " + ", ".join(
                    f"{k} {fmt_s(samples.values[k]['s'][-1])}" for k in systems), flush=True)

    first = Table(
        f"zarr view: read 1% of the rows ({human_bytes(slice_bytes)}) of one "
        f"{size_label(nbytes)} fp32 tensor [{rows} x {cols}] vs restore the whole step, "
        f"median of {rounds}",
        ["over", "slice via zarr view", "chunks read", "whole-step restore", "slice / restore",
         "target <= 0.05x"],
    )
    for over, url in (("http (ckptd serve)", server.url), ("file://", file_url)):
        key = "http" if over.startswith("http") else "file"
        s, r = samples.median(f"slice {key}", "s"), samples.median(f"restore {key}", "s")
        x = ratio(s, r)
        first.add(over, fmt_s(s), str(fetched.get(url, "-")), fmt_s(r), fmt_x(x),
                  "yes" if x <= 0.05 else "no")
    first.note("The slice opens a fresh CheckpointStore each round (commit record and "
               "manifest reads included) and verifies every chunk it reads; the restore "
               "fills an existing tensor from the store tier, verified too. Page cache warm.")
    second = Table(
        f"export --zarr of the step vs dcp.save of the same state ({human_bytes(nbytes)}), "
        f"median of {rounds}",
        ["writer", "time", "GB/s", "vs dcp.save", "range"],
    )
    base = samples.median("dcp.save", "s")
    for name, label in (("export", "ckptd export --zarr (no codec)"),
                        ("export zstd", "ckptd export --zarr --codec zstd"),
                        ("dcp.save", "dcp.save (FileSystemWriter)")):
        t = samples.median(name, "s")
        second.add(label, fmt_s(t), fmt_gbps(nbytes, t), fmt_x(ratio(t, base)),
                   samples.spread(name, "s"))
    second.note("Export reads every chunk from the store (file://, page cache) and hashes it "
                "before writing; dcp.save writes from memory. Neither fsyncs. zstd on random "
                "fp32 data costs CPU and saves little. Ratios above 1 are slower than dcp.save.")
    return [first, second], info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="tensor size (default 1G)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="parent of the scratch directory")
    parser.add_argument("--markdown", default=None, help="write the tables to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gc.collect()
    tables, info = run(parse_size(args.size), args.rounds, args.scratch)
    for t in tables:
        t.print()
    if args.markdown:
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info]
        Path(args.markdown).write_text(
            "\n".join(t.markdown() for t in tables) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
