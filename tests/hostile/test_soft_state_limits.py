"""Server memory outside the chunk uploads stays bounded: manifest bodies count in
the ingest budget, and heartbeats keep a bounded amount of soft state (jobs, ranks,
signal bytes per rank), refusing what is past it with a typed error."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from ckptd.hashing import chunk_id
from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(store=tmp_path_factory.mktemp("limits") / "store", env={
        "CKPTD_INGEST_BUDGET": str(8 << 20), "CKPTD_INGEST_WAIT": "0.5",
        "CKPTD_BODY_TIMEOUT": "10", "CKPTD_HEARTBEAT_MAX_JOBS": "2",
        "CKPTD_HEARTBEAT_MAX_RANKS": "3", "CKPTD_HEARTBEAT_SIGNAL_BYTES": "2048"})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_a_manifest_body_counts_in_the_ingest_budget(limited: ServerProcess) -> None:
    # One manifest upload that declares 7 MiB and stalls holds the 8 MiB budget.
    s = socket.create_connection(("127.0.0.1", limited.port), timeout=10)
    try:
        s.sendall(b"PUT /v1/jobs/m/steps/1/ranks/0 HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: " + str(7 << 20).encode()
                  + b"\r\n\r\n[" + b"0," * 512)
        time.sleep(0.5)
        body = b"[" + b"0," * (1 << 20) + b"0]"  # 2 MiB, not a manifest
        r = httpx.put(f"{limited.url}/v1/jobs/m/steps/2/ranks/0", content=body, timeout=30,
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "unavailable" and "retry-after" in r.headers
        data = b"c" * (2 << 20)  # and a chunk upload shares the same budget
        r = httpx.put(f"{limited.url}/v1/chunks/{chunk_id(data)}", content=data, timeout=30)
        assert r.status_code == 503, r.text
    finally:
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the closed upload gives its reservation back
        r = httpx.put(f"{limited.url}/v1/jobs/m/steps/2/ranks/0", content=body, timeout=30,
                      headers={"Content-Type": "application/json"})
        if r.status_code != 503:
            break
        time.sleep(0.2)
    assert r.status_code == 400 and r.json()["code"] == "invalid_document", r.text


def _beat(srv: ServerProcess, job: str, rank: int, signals: dict[str, float] | None = None
          ) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/jobs/{job}/ranks/{rank}/heartbeat", timeout=30, json={
        "world_size": 1 << 20, "health": {"state": "ok", "signals": signals or {}}})


def test_heartbeats_keep_bounded_soft_state(limited: ServerProcess) -> None:
    big = {f"s{i:04d}" + "x" * 900: float(i) for i in range(1024)}  # ~1 MiB of signals
    r = _beat(limited, "a", 0, big)
    assert r.status_code == 200, r.text
    ranks = httpx.get(f"{limited.url}/v1/jobs/a/ranks", timeout=30).json()["ranks"]
    signals = ranks[0]["health"]["signals"]
    assert sum(len(k) + 8 for k in signals) <= 2048 + 64
    assert signals["ckptd_signals_dropped"] == 1024 - (len(signals) - 1)
    assert _beat(limited, "a", 1).status_code == 200
    assert _beat(limited, "b", 0).status_code == 200
    r = _beat(limited, "c", 0)  # a third job
    assert r.status_code == 413 and r.json()["code"] == "too_large", r.text
    r = _beat(limited, "b", 1)  # a fourth rank
    assert r.status_code == 413 and r.json()["code"] == "too_large", r.text
    assert _beat(limited, "a", 1).status_code == 200  # the known ones keep beating
