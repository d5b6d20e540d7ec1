"""Commit of large manifests, and how responsive the server stays meanwhile.

    python -m bench.commit_scale            # 64 ranks x 2,000 tensors, 1 rank x 100,000
    python -m bench.commit_scale --quick    # 16 x 2,000 and 1 x 20,000
    python -m bench.commit_scale --scaling  # adds 1 x 50,000 and 1 x 200,000 (near-linear?)

For each shape it PUTs every rank's manifest (all ranks at once), commits, and asks
for rank 0's restore plan, while a thread polls ``GET /healthz`` every 10 ms; it
prints each phase's time and the worst /healthz latency during it. Peers measured
in the same run on the same state: ``torch.save`` of the 100,000 (tiny) tensors and
``dcp.save`` with a ``FileSystemWriter`` (its planning and metadata are the part that
grows with the tensor count). ckptd's design targets: /healthz worst < 200 ms,
commit of 100,000 tensors < 2 s. The machine is shared (2 cores, other work
running): the output says how many CPUs it saw and its load average."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from bench.common import Server, fmt_x, ratio, scratch_dir
from ckptd.hashing import chunk_id
from ckptd.testing.manifests import many_tensor_manifests

# The poller runs in its own process: a thread beside the benchmark's 16 upload
# threads would measure this process's GIL, not the server.
_POLLER = """
import sys, time, http.client
host, port, every = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = http.client.HTTPConnection(host, port, timeout=60)
worst, n = 0.0, 0
while sys.stdin.readline() == "go\\n":
    t0 = time.perf_counter()
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        worst = max(worst, time.perf_counter() - t0)
    except (OSError, http.client.HTTPException):
        conn.close()  # (a closed keep-alive connection: the next request reopens it)
    n += 1
    print(f"{worst} {n}", flush=True)
"""


class HealthWatch:
    """Polls /healthz about every ``every`` s from another process; the worst
    latency seen."""

    def __init__(self, url: str, every: float = 0.01) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.every = every
        self.worst = 0.0
        self.samples = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _POLLER, host, port, str(every)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        while not self._stop.is_set():
            self._proc.stdin.write("go\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline().split()
            if len(line) != 2:
                break
            self.worst, self.samples = float(line[0]), int(line[1])
            self._stop.wait(self.every)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(30)


def commit_round(url: str, job: str, world: int, tensors: int) -> dict[str, float]:
    """PUT all manifests, commit, restore plan; seconds and worst /healthz of each."""
    manifests, data = many_tensor_manifests(job, 1, world, tensors)
    bodies = [m.canonical() for m in manifests]
    out: dict[str, float] = {"manifest_mib": len(bodies[0]) / (1 << 20)}
    with httpx.Client(base_url=url, timeout=600) as c:
        assert c.put(f"/v1/chunks/{chunk_id(data)}", content=data).status_code in (200, 201)

        def put(rank: int) -> None:
            r = c.put(f"/v1/jobs/{job}/steps/1/ranks/{rank}", content=bodies[rank])
            assert r.status_code == 201, r.text

        with HealthWatch(url) as watch:
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(min(world, 16)) as pool:
                list(pool.map(put, range(world)))
            out["put_s"] = time.perf_counter() - t0
        out["put_health_ms"] = watch.worst * 1000
        with HealthWatch(url) as watch:
            t0 = time.perf_counter()
            r = c.post(f"/v1/jobs/{job}/steps/1/commit")
            out["commit_s"] = time.perf_counter() - t0
            assert r.status_code == 200 and r.json()["state"] == "committed", r.text
        out["commit_health_ms"] = watch.worst * 1000
        with HealthWatch(url) as watch:
            t0 = time.perf_counter()
            r = c.get(f"/v1/jobs/{job}/restore-plan", params={"rank": "0"})
            out["plan_s"] = time.perf_counter() - t0
            assert r.status_code == 200, r.text[:200]
        out["plan_health_ms"] = watch.worst * 1000
    return out


def peers(tensors: int, root: Path) -> dict[str, float]:
    """torch.save and dcp.save of the same many tiny tensors, seconds."""
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i // 8}.p{i % 8}": torch.arange(16, dtype=torch.float32)
             for i in range(tensors)}
    t0 = time.perf_counter()
    torch.save(state, root / "state.pt")
    saved = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "dcp")), no_dist=True)
    return {"torch.save": saved, "dcp.save": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scaling", action="store_true",
                        help="also 1 x 50,000 and 1 x 200,000 tensors, to see how time grows")
    parser.add_argument("--dir", default=None, help="scratch directory parent")
    args = parser.parse_args(argv)
    shapes = [(16, 2_000), (1, 20_000)] if args.quick else [(64, 2_000), (1, 100_000)]
    if args.scaling:
        shapes += [(1, 50_000), (1, 200_000)]
    load = os.getloadavg()
    print(f"commit_scale: {os.cpu_count()} CPUs seen, load average {load[0]:.1f} "
          f"{load[1]:.1f} {load[2]:.1f} (a shared machine: other work runs beside this)")
    with scratch_dir(args.dir or tempfile.gettempdir()) as root:
        with Server(root / "store", root / "server.log") as server:
            results: dict[tuple[int, int], dict[str, float]] = {}
            for world, tensors in shapes:
                r = results[(world, tensors)] = commit_round(
                    server.url, f"scale-{world}x{tensors}", world, tensors)
                print(f"  {world} x {tensors}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in r.items()), flush=True)
        largest = max(t for _, t in shapes[:2])  # (the peers' state: --scaling adds none)
        peer = peers(largest, root)
    print(f"\n{'shape':>14} {'manifest':>9} {'put':>8} {'commit':>8} {'plan':>8} "
          f"{'/healthz worst (put, commit, plan)':>36}")
    for (world, tensors), r in results.items():
        print(f"{world:>4} x {tensors:>7} {r['manifest_mib']:>6.1f} MiB {r['put_s']:>7.2f}s "
              f"{r['commit_s']:>7.2f}s {r['plan_s']:>7.2f}s "
              f"{r['put_health_ms']:>10.0f} ms {r['commit_health_ms']:>7.0f} ms "
              f"{r['plan_health_ms']:>7.0f} ms")
    if args.scaling:
        print("\nper tensor, 1 rank (near-linear growth keeps these flat):")
        for (world, tensors), r in sorted(results.items(), key=lambda kv: kv[0][1]):
            if world == 1:
                print(f"  {tensors:>7,} tensors: put {r['put_s'] / tensors * 1e6:5.1f} us, "
                      f"commit {r['commit_s'] / tensors * 1e6:5.1f} us, "
                      f"plan {r['plan_s'] / tensors * 1e6:5.1f} us")
    big = results[(1, largest)]
    print(f"\npeers on the same {largest:,} tensors: torch.save {peer['torch.save']:.2f}s, "
          f"dcp.save {peer['dcp.save']:.2f}s")
    print(f"ckptd commit / torch.save: {fmt_x(ratio(big['commit_s'], peer['torch.save']))}; "
          f"ckptd put+commit / dcp.save: "
          f"{fmt_x(ratio(big['put_s'] + big['commit_s'], peer['dcp.save']))}")
    worst = max(max(r["put_health_ms"], r["commit_health_ms"], r["plan_health_ms"])
                for r in results.values())
    print(f"targets: /healthz worst {worst:.0f} ms (< 200 ms: "
          f"{'met' if worst < 200 else 'NOT met'}); commit of {largest:,} tensors "
          f"{big['commit_s']:.2f} s (< 2 s: {'met' if big['commit_s'] < 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
