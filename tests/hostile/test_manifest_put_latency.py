"""Putting large manifests keeps /healthz answering (issue 10 item 2, the PUT):
three ranks of 40,000 tensors each are put one after the other while /healthz is
polled. Before, the parse of each set off full garbage collections over every
parsed manifest the server held (0.3-1.7 s with the GIL held); the benchmark
(bench/commit_scale.py) holds the real target, /healthz < 200 ms."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ckptd.hashing import chunk_id
from ckptd.testing.manifests import many_tensor_manifests
from tests.conftest import ServerProcess

TENSORS = 40_000
RANKS = 3
# Loose for a busy 2-core machine; the old code stalled 0.7-1.0 s here, and a
# compaction of the frozen set at the server's first manifest 0.25 s idle, 0.58 s
# in a loaded CI run (0.12 s idle without it).
WORST_HEALTH_S = 0.5


@pytest.mark.slow
def test_putting_large_manifests_keeps_health_answering(server: ServerProcess) -> None:
    manifests, data = many_tensor_manifests("moe-put", 1, RANKS, TENSORS)
    bodies = [m.canonical() for m in manifests]
    del manifests
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                latencies.append(time.perf_counter() - t0)
                stop.wait(0.01)

    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.put(f"/v1/chunks/{chunk_id(data)}", content=data).status_code in (200, 201)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            for rank, body in enumerate(bodies):
                r = c.put(f"/v1/jobs/moe-put/steps/1/ranks/{rank}", content=body)
                assert r.status_code == 201, r.text[:300]
        finally:
            stop.set()
            poller.join(60)
    assert len(latencies) > 10, latencies  # the poller saw the puts
    assert max(latencies) < WORST_HEALTH_S, (max(latencies), len(latencies))
