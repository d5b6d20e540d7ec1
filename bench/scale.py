"""Scale-out: aggregate time to committed of R ranks with 1, 2 and 4 ckptd replicas
over one shared directory store, beside ``dcp.save`` of the same state by R gloo
ranks to the same disk; and a model of the replicas a large job needs.

    python -m bench.scale                          # 8 ranks x 512 MiB, 1/2/4 replicas
    python -m bench.scale --ranks 8 --size 16M     # a smoke run (2-core CI machine)

Every rank holds its own state (``default_placement="local"``: nothing to dedup),
saves it once after a barrier; the time is from the first rank's save to the last
rank's committed answer. The clients get every replica's URL and route each chunk
to its home replica (rendezvous hashing), so ingest spreads over the replicas.
ckptd's design targets, on a machine with >= 16 cores: 4 replicas >= 3x the
ingest of 1; 4 replicas <= 1.0x ``dcp.save``.

Beside wall time, each replica's CPU (psutil: user + system, every thread, and its
event-loop thread alone) per GiB it ingested: a figure that holds on a machine
whose cores the ranks share, and the model it implies. CPU-s per GB is the cores
a GB/s of ingest takes; one replica's event loop is one thread, so a replica
ingests at most 1 / (its loop's CPU-s per GB) GB/s, whatever its cores.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

from bench.common import (
    Table,
    dir_bytes,
    fmt_s,
    fmt_x,
    free_port,
    human_bytes,
    machine,
    make_state,
    parse_size,
    quiesce,
    ratio,
    scratch_dir,
    size_label,
    state_nbytes,
)

# The model's job: 1,000 ranks x 10 GB committed within 5 minutes.
MODEL_RANKS, MODEL_BYTES, MODEL_SECONDS = 1000, 10 * 10**9, 300.0


def _rank_state(nbytes: int, rank: int) -> dict[str, Any]:
    # Names carry the rank: DCP would otherwise take equal names as replicas and
    # write them once; ckptd saves them rank-private (default_placement="local").
    return {f"rank{rank}": make_state(nbytes, seed=100 + rank)}


def _ckptd_worker(urls: str, job: str, rank: int, world: int, nbytes: int,
                  barrier: Any, queue: Any) -> None:
    try:
        from ckptd.client import Checkpointer

        state = _rank_state(nbytes, rank)
        with Checkpointer(urls, job, rank=rank, world_size=world, default_placement="local",
                          serve_peers=False) as ckpt:
            barrier.wait()
            t0 = time.time()
            result = ckpt.save(1, state).wait()
            queue.put({"rank": rank, "start": t0, "end": time.time(), "state": result.state,
                       "sent": result.bytes_sent})
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _dcp_worker(path: str, init: str, rank: int, world: int, nbytes: int,
                barrier: Any, queue: Any) -> None:
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        state = _rank_state(nbytes, rank)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world)
        barrier.wait()
        t0 = time.time()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        queue.put({"rank": rank, "start": t0, "end": time.time()})
        dist.destroy_process_group()
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _run_group(target: Any, args_of: Any, world: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), barrier, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError("a worker failed:\n" + errors[0])
    return out


class Replicas:
    """``n`` ``ckptd serve`` processes over one directory store, each told of all."""

    def __init__(self, n: int, store: Path, logs: Path) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.urls = ",".join(f"http://127.0.0.1:{p}" for p in self.ports)
        self.store, self.logs = store, logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Replicas:
        import httpx

        for port in self.ports:
            with open(self.logs / f"replica-{port}.log", "ab") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ckptd", "serve", "--store", str(self.store),
                     "--host", "127.0.0.1", "--port", str(port), "--peers", self.urls,
                     "--no-access-log"], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        for port in self.ports:
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica {port} did not start") from None
                    time.sleep(0.1)
        return self

    def cpu(self) -> list[tuple[float, float]]:
        """Each replica's CPU seconds so far: (every thread, its event-loop thread)."""
        out = []
        for p in self.procs:
            proc = psutil.Process(p.pid)
            times = proc.cpu_times()
            loop = next((t.user_time + t.system_time for t in proc.threads() if t.id == p.pid),
                        0.0)
            out.append((times.user + times.system, loop))
        return out

    def ingested(self) -> list[float | None]:
        """Bytes of chunk uploads each replica received (its /metrics), if it says."""
        import httpx

        out: list[float | None] = []
        for port in self.ports:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            except httpx.HTTPError:
                out.append(None)
                continue
            found = re.search(r"^ckptd_chunk_upload_bytes_sum (\S+)$", text, re.MULTILINE)
            out.append(float(found.group(1)) if found else None)
        return out

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--size", default="512M", help="state per rank")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--scratch", default=None, help="where stores and DCP write")
    args = ap.parse_args(argv)
    nbytes, world = parse_size(args.size), args.ranks
    counts = [int(x) for x in args.replicas.split(",")]

    with scratch_dir(args.scratch) as work:
        for key, value in machine(work):
            print(f"{key}: {value}")
        real = state_nbytes(_rank_state(nbytes, 0)) * world
        times: dict[str, float] = {}
        cpu: dict[int, list[dict[str, float]]] = {}
        for n in counts:
            quiesce()
            store = work / f"store-{n}"
            store.mkdir()
            with Replicas(n, store, work) as cluster:
                before = cluster.cpu()
                out = _run_group(_ckptd_worker, lambda r, c=cluster, n=n:
                                 (c.urls, f"scale-{n}", r, world, nbytes), world)
                after = cluster.cpu()
                ingested = cluster.ingested()
            cpu[n] = [{"cpu": a[0] - b[0], "loop": a[1] - b[1],
                       "bytes": got if got else real / n}
                      for a, b, got in zip(after, before, ingested, strict=True)]
            if "committed" not in {o["state"] for o in out}:
                raise RuntimeError(f"{n} replicas: the step did not commit")
            times[f"ckptd, {n} replica{'s' if n > 1 else ''}"] = (
                max(o["end"] for o in out) - min(o["start"] for o in out))
            print(f"{n} replicas: stored {human_bytes(dir_bytes(store / 'chunks'))}",
                  flush=True)
        quiesce()
        out = _run_group(_dcp_worker, lambda r: (str(work / "dcp"), str(work / "dcp-init"),
                                                 r, world, nbytes), world)
        dcp_t = max(o["end"] for o in out) - min(o["start"] for o in out)

    one = next(iter(times.values()))
    table = Table(f"{world} ranks x {size_label(nbytes)} to committed, one shared directory",
                  ["system", "time to committed", "GB/s", "ingest / 1 replica",
                   "time / dcp.save"])
    for name, t in times.items():
        table.add(name, fmt_s(t), f"{real / t / 1e9:.2f}", fmt_x(ratio(one, t)),
                  fmt_x(ratio(t, dcp_t)))
    table.add(f"dcp.save FileSystemWriter, {world} gloo ranks", fmt_s(dcp_t),
              f"{real / dcp_t / 1e9:.2f}", "-", "1.00x")
    table.note("Ranks and replicas share this machine's cores: the replica columns mean "
               "something only where cores outnumber ranks + replicas (the targets assume "
               ">= 16 cores).")
    table.print()

    per = Table("Each replica's CPU per GiB it ingested (psutil: the whole process, and its "
                "event-loop thread)", ["replicas", "replica", "GiB ingested", "CPU-s per GiB",
                                       "loop thread CPU-s per GiB"])
    for n, rows in cpu.items():
        for i, row in enumerate(rows):
            gib = row["bytes"] / (1 << 30)
            per.add(n, i, f"{gib:.2f}", f"{row['cpu'] / gib:.2f}", f"{row['loop'] / gib:.2f}")
    per.note(f"{os.cpu_count()} cores on this machine, shared by {world} ranks and the "
             "replicas: CPU time, unlike wall time, still says what a GiB costs.")
    per.print()

    # The model from CPU: cores per GB/s is CPU-s per GB; a replica's event loop is
    # one thread, so its loop's CPU-s per GB bounds what one replica ingests.
    all_rows = [row for rows in cpu.values() for row in rows]
    cpu_per_gb = statistics.median(r["cpu"] / (r["bytes"] / 1e9) for r in all_rows)
    loop_per_gb = statistics.median(r["loop"] / (r["bytes"] / 1e9) for r in all_rows)
    need = MODEL_RANKS * MODEL_BYTES / MODEL_SECONDS / 1e9  # GB/s
    one_replica = 1 / loop_per_gb if loop_per_gb else float("inf")
    replicas = math.ceil(need / one_replica)
    print(f"\nmodel (CPU): {cpu_per_gb:.2f} CPU-s per GB ingested, {loop_per_gb:.2f} of it on "
          f"the event-loop thread (medians over every replica of every run), so "
          f"{cpu_per_gb:.2f} cores per GB/s ingested; one replica's loop saturates at "
          f"{one_replica:.2f} GB/s. {MODEL_RANKS} ranks x {MODEL_BYTES / 1e9:.0f} GB within "
          f"{MODEL_SECONDS / 60:.0f} min is {need:.1f} GB/s: {need * cpu_per_gb:.0f} cores of "
          f"ckptd, as at least {replicas} replicas of {cpu_per_gb / loop_per_gb:.1f} cores "
          f"each, if the store takes {need:.1f} GB/s.")

    # The model from wall time: the per-replica rate is the best measured aggregate
    # over its replica count (so measured scaling losses stay in), and replicas add up.
    best_n, best_t = max(((n, t) for n, t in zip(counts, times.values(), strict=True)),
                         key=lambda nt: real / nt[1])
    per_replica = real / best_t / best_n
    print(f"model (wall time): at {per_replica / 1e9:.3f} GB/s per replica (measured with "
          f"{best_n}, ranks and replicas on {os.cpu_count()} shared cores) that is "
          f"{math.ceil(need * 1e9 / per_replica)} replicas.")
    four = times.get("ckptd, 4 replicas")
    if four is not None:
        cores = os.cpu_count() or 1
        caveat = ("" if cores >= 16 else
                  f" (not meaningful: {cores} cores, the targets assume >= 16)")
        print(f"targets: 4 replicas / 1 ingest {one / four:.2f}x (>= 3x); "
              f"4 replicas / dcp.save {four / dcp_t:.2f}x (<= 1.0x){caveat}")


if __name__ == "__main__":
    main()
