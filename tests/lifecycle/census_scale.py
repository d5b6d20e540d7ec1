"""Two real servers side by side, one over an empty store and one over a store of a
million tensor entries (``ckptd.testing.big_store``), started together; saves of
256 KiB alternate between them while another process polls both ``/healthz``
and ``GET /v1/space`` is asked of the large one, until its census has counted
everything. Used by ``test_census_scale.py`` and ``bench/census.py``."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from ckptd.client import Checkpointer
from ckptd.store import LocalStore
from ckptd.testing.big_store import BigStore, big_chunks, fill, manifest_bytes
from tests.conftest import ServerProcess

# One process polls both servers' /healthz in turn (a thread in this process would
# measure this process's GIL, busy with the saves).
_POLLER = """
import sys, time, http.client
urls = sys.argv[1:]
conns = [http.client.HTTPConnection(*u.split(":"), timeout=60) for u in urls]
while True:
    for i, c in enumerate(conns):
        t0 = time.perf_counter()
        try:
            c.request("GET", "/healthz")
            c.getresponse().read()
            print(i, time.perf_counter() - t0, flush=True)
        except (OSError, http.client.HTTPException):
            c.close()
    time.sleep(0.02)
"""


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Side:
    """What was measured against one server."""

    saves: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    space: list[float] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)  # of a large step, if asked
    peak_rss: int = 0  # the server's VmHWM at the end
    worker_peak_rss: int = 0  # its census worker's

    def row(self) -> dict[str, float]:
        return {"save_median": statistics.median(self.saves),
                "save_p90": quantile(self.saves, 0.9),
                "health_median": statistics.median(self.health),
                "health_p90": quantile(self.health, 0.9),
                "health_worst": max(self.health),
                "space_worst": max(self.space) if self.space else float("nan"),
                "commit_median": statistics.median(self.commits) if self.commits
                else float("nan")}


@dataclass
class Run:
    big: BigStore
    empty: Side
    full: Side
    census_s: float  # from the large server's start until its census counted everything
    final: dict[str, Any]  # its last GET /v1/space
    fill_s: float


def measure(root: Path, shm: Path, *, jobs: int = 2, steps: int = 2, world_size: int = 2,
            tensors: int = 125_000, min_rounds: int = 12, max_s: float = 240.0,
            commit_tensors: int = 0, commit_rounds: int = 2) -> Run:
    """With ``commit_tensors``, first puts and commits that many tensors (one rank)
    ``commit_rounds`` times on each server, timing the commit call, while the large
    store's census counts."""
    t0 = time.perf_counter()
    big = asyncio.run(fill(LocalStore(root / "big" / "store", fsync=False),
                           jobs=[f"moe-{i}" for i in range(jobs)],
                           steps=list(range(1, steps + 1)), world_size=world_size,
                           tensors=tensors))
    fill_s = time.perf_counter() - t0
    servers = [ServerProcess(store=root / "empty" / "store"),
               ServerProcess(store=root / "big" / "store")]
    (root / "empty").mkdir(exist_ok=True)
    sides = [Side(), Side()]
    poller: subprocess.Popen[str] | None = None
    ckpts: list[Checkpointer] = []
    try:
        started = time.monotonic()
        for srv in servers:
            srv.start()
        for srv in servers:  # (FastAPI's first request on a route costs a little)
            httpx.get(f"{srv.url}/v1/jobs", timeout=30)
        poller = subprocess.Popen(
            [sys.executable, "-c", _POLLER, *(s.url.removeprefix("http://") for s in servers)],
            stdout=subprocess.PIPE, text=True)
        if commit_tensors:
            _commits(servers, sides, commit_tensors, commit_rounds)
        ckpts = [Checkpointer(s.url, "saves", shm_dir=shm / str(i), serve_peers=False,
                              timeout=120) for i, s in enumerate(servers)]
        state = {"w": torch.zeros(64 * 1024)}  # 256 KiB
        census_s = float("nan")
        final: dict[str, Any] = {}
        step = 0
        stalled = False  # a GET /v1/space timed out: not asked again
        with httpx.Client(timeout=10.0) as http:
            while time.monotonic() - started < max_s:
                step += 1
                for i in (step % 2, 1 - step % 2):  # each round in a new order
                    state["w"].normal_()
                    t = time.perf_counter()
                    assert ckpts[i].save(step, state).wait(timeout=120).state == "committed"
                    sides[i].saves.append(time.perf_counter() - t)
                    if stalled:
                        continue
                    t = time.perf_counter()
                    try:
                        r = http.get(f"{servers[i].url}/v1/space")
                    except httpx.TimeoutException:  # (the old census: tens of seconds)
                        sides[i].space.append(time.perf_counter() - t)
                        stalled = True
                        continue
                    sides[i].space.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
                    if i == 1:
                        final = r.json()
                if final.get("complete") and census_s != census_s:
                    census_s = time.monotonic() - started
                if (census_s == census_s or stalled) and step >= min_rounds:
                    break
    finally:
        for c in ckpts:
            with contextlib.suppress(Exception):
                c.close()
        if poller is not None:
            poller.kill()
            out, _ = poller.communicate(timeout=30)
            for line in out.splitlines():
                parts = line.split()
                if len(parts) == 2:  # (the kill may cut the last line short)
                    sides[int(parts[0])].health.append(float(parts[1]))
        for srv, side in zip(servers, sides, strict=True):
            side.peak_rss, side.worker_peak_rss = _peaks(srv)
            srv.stop()
    return Run(big, sides[0], sides[1], census_s, final, fill_s)


def _commits(servers: list[ServerProcess], sides: list[Side], tensors: int, rounds: int
             ) -> None:
    data = big_chunks(1, seed="commits")
    ids = sorted(data)
    with httpx.Client(timeout=600.0) as http:
        for srv in servers:
            cid = ids[0]
            assert http.put(f"{srv.url}/v1/chunks/{cid}", content=data[cid]).status_code < 300
        for step in range(1, rounds + 1):
            body = manifest_bytes("commits", step, 0, 1, tensors, ids)
            for i in (step % 2, 1 - step % 2):
                url = f"{servers[i].url}/v1/jobs/commits/steps/{step}"
                r = http.put(f"{url}/ranks/0", content=body)
                assert r.status_code == 201, r.text[:300]
                t = time.perf_counter()
                r = http.post(f"{url}/commit", json={})
                sides[i].commits.append(time.perf_counter() - t)
                assert r.status_code == 200 and r.json()["state"] == "committed", r.text[:300]


def _peak(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _peaks(srv: ServerProcess) -> tuple[int, int]:
    """(VmHWM of the server, of its child processes summed: the census worker)."""
    if srv.proc is None:
        return 0, 0
    kids = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{srv.proc.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                kids += _peak(int(child))
    return _peak(srv.proc.pid), kids
