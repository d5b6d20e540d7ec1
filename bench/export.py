"""``ckptd export --safetensors`` against ``safetensors.torch.save_file`` of the same
tensors from memory (issue 22: <= 1.2x its time, peak memory <= one shard file).

    python -m bench.export [--size 1G] [--rounds 3] [--markdown FILE]

A training state of ``--size`` bytes (bench.common.make_state: bf16 weights, fp32
AdamW moments) is saved as one step by a real ``ckptd serve`` over a local
directory store. Each round, in rotated order: ``save_file`` of the state's
tensors (flat, the names the export writes) from memory into one file; the
export of the step over ``file://`` into one file (the default 5GB limit) and
into files of at most 256MB; the same export through the server (http). Every
export reads each chunk from the store and verifies it. Nothing fsyncs; page
cache warm. Peak memory: each writer once more in a fresh process, the rise of
its high-water mark (VmHWM) over its resident size just before the call.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    Samples,
    Server,
    Table,
    fmt_gbps,
    fmt_s,
    fmt_x,
    human_bytes,
    machine,
    make_state,
    parse_size,
    proc_status,
    quiesce,
    ratio,
    rotated,
    scratch_dir,
    size_label,
)

JOB = "exportbench"
STEP = 1
SMALL_SHARD = "256MB"


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from ckptd.client.save.flatten import flatten

    return dict(flatten(state).tensors)


def child(args: list[str]) -> None:
    """One writer in this fresh process: prints seconds and the rise of VmHWM."""
    kind, *rest = args
    if kind == "save_file":
        from safetensors.torch import save_file

        size, out = int(rest[0]), rest[1]
        tensors = flat_tensors(make_state(size))
        before = proc_status()
        t0 = time.perf_counter()
        save_file(tensors, out)
    else:
        from ckptd.client.integrations.safetensors import export_safetensors

        url, out, shard = rest
        before = proc_status()
        t0 = time.perf_counter()
        export_safetensors(url, JOB, out, STEP, max_shard_size=shard)
    seconds = time.perf_counter() - t0
    after = proc_status()
    print(json.dumps({"seconds": seconds, "rise": after["VmHWM"] - before["VmRSS"]}))


def server_cpu(server: Server) -> float:
    """User + system CPU seconds of the server process so far."""
    assert server.proc is not None
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak(args: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "bench.export", "--child", *args],
                          capture_output=True, text=True, check=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run(size: int, rounds: int, parent: str | None) -> tuple[list[Table], list[tuple[str, str]]]:
    from safetensors.torch import save_file

    from ckptd.client import Checkpointer
    from ckptd.client.integrations.safetensors import export_safetensors
    from ckptd.client.integrations.safetensors import parse_size as shard_size

    with scratch_dir(parent) as scratch:
        info = machine(scratch)
        with Server(scratch / "store", scratch / "server.log") as server:
            state = make_state(size)
            tensors = flat_tensors(state)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            with Checkpointer(server.url, JOB, serve_peers=False) as ckpt:
                ckpt.save(STEP, state).wait(timeout=900)
            file_url = f"file://{scratch / 'store'}"
            samples = Samples()
            files: dict[str, int] = {}

            def cpu() -> float:
                """CPU seconds of this process and the server so far (all threads)."""
                return time.process_time() + server_cpu(server)

            def baseline() -> tuple[float, float]:
                out = scratch / "ref.safetensors"
                c0, t0 = cpu(), time.perf_counter()
                save_file(tensors, out)
                seconds, used = time.perf_counter() - t0, cpu() - c0
                out.unlink()
                return seconds, used

            def export(url: str, shard: str, name: str) -> tuple[float, float]:
                out = scratch / "export"
                shutil.rmtree(out, ignore_errors=True)
                c0, t0 = cpu(), time.perf_counter()
                result = export_safetensors(url, JOB, out, STEP, max_shard_size=shard)
                seconds, used = time.perf_counter() - t0, cpu() - c0
                files[name] = len(result.files)
                shutil.rmtree(out)
                return seconds, used

            systems = {
                "save_file": baseline,
                "file": lambda: export(file_url, "5GB", "file"),
                "file small": lambda: export(file_url, SMALL_SHARD, "file small"),
                "http": lambda: export(server.url, "5GB", "http"),
            }
            for name in systems:  # warm-up: the page cache holds the store afterwards
                systems[name]()
            for rnd in range(rounds):
                for name in rotated(list(systems), rnd):
                    quiesce()
                    seconds, used = systems[name]()
                    samples.add(name, "s", seconds)
                    samples.add(name, "cpu", used)
                print(f"round {rnd + 1}/{rounds}: " + ", ".join(
                    f"{k} {fmt_s(samples.values[k]['s'][-1])}" for k in systems), flush=True)
            state.clear()
            tensors.clear()  # (the children make their own)
            gc.collect()
            memory = {
                "save_file": peak(["save_file", str(size), str(scratch / "m.safetensors")]),
                "file": peak(["export", file_url, str(scratch / "m1"), "5GB"]),
                "file small": peak(["export", file_url, str(scratch / "m2"), SMALL_SHARD]),
            }

    table = Table(
        f"export --safetensors of a {size_label(size)} step ({human_bytes(nbytes)} of "
        f"tensors) vs safetensors.torch.save_file from memory, median of {rounds}",
        ["writer", "files", "time", "GB/s", "vs save_file", "target <= 1.2x",
         "fastest vs fastest", "CPU s", "CPU vs save_file", "peak memory rise",
         "largest file", "range"],
    )
    base = samples.median("save_file", "s")
    base_best = min(samples.values["save_file"]["s"])
    base_cpu = samples.median("save_file", "cpu")
    shard_bytes = shard_size(SMALL_SHARD)
    rows = (("save_file", "safetensors.torch.save_file (memory -> 1 file)", None),
            ("file", "ckptd export, file:// store, 5GB files", nbytes),
            ("file small", f"ckptd export, file:// store, {SMALL_SHARD} files", shard_bytes),
            ("http", "ckptd export, through ckptd serve, 5GB files", nbytes))
    for name, label, largest in rows:
        t = samples.median(name, "s")
        x = ratio(t, base)
        rise = memory.get(name, {}).get("rise")
        c = samples.median(name, "cpu")
        table.add(label, str(files.get(name, 1)), fmt_s(t), fmt_gbps(nbytes, t), fmt_x(x),
                  "-" if name == "save_file" else ("yes" if x <= 1.2 else "no"),
                  fmt_x(ratio(min(samples.values[name]["s"]), base_best)),
                  f"{c:.2f}", fmt_x(ratio(c, base_cpu)), human_bytes(rise),
                  "-" if largest is None else human_bytes(min(largest, nbytes)),
                  samples.spread(name, "s"))
    table.note("Every export reads each chunk from the store (page cache) and checks its "
               "blake3 (a chunk file on this host as it copies it, a piece at a time: one "
               "that does not verify is written again from another tier; any other before "
               "it is written); save_file writes tensors already in memory. Neither "
               "fsyncs. CPU s: user + system seconds of the bench process (all threads) and, "
               "for http, of the server. Peak memory rise: VmHWM in a fresh process minus its "
               "VmRSS just before the call (save_file's state itself excluded); the target is "
               "at most one shard file (the largest file written). Fastest vs fastest: "
               "each writer's least disturbed round against save_file's, where a VM's "
               "memory moves the medians.")
    return [table], info


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="state size (default 1G)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="parent of the scratch directory")
    parser.add_argument("--markdown", default=None, help="write the tables to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tables, info = run(parse_size(args.size), args.rounds, args.scratch)
    for t in tables:
        t.print()
    if args.markdown:
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info]
        Path(args.markdown).write_text(
            "\n".join(t.markdown() for t in tables) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
