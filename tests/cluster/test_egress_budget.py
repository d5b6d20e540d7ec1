"""Chunk reads of a store whose chunks are not files here (S3) are read whole into
memory: every such answer together holds at most the egress budget, and a read past
it waits, then is refused with a 503 the reader retries (not one more chunk held
for each slow reader)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.hashing import chunk_id
from tests.cluster.conftest import BUCKET, Replica

CHUNK = 12 << 20


@pytest.fixture
def s3_server(moto_endpoint: str, tmp_path: Path) -> Iterator[Replica]:
    srv = Replica(f"s3://{BUCKET}/{uuid.uuid4().hex}?endpoint={moto_endpoint}", tmp_path,
                  env={"CKPTD_EGRESS_BUDGET": str(16 << 20), "CKPTD_EGRESS_WAIT": "0.5"})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_slow_readers_of_s3_chunks_share_one_memory_budget(s3_server: Replica) -> None:
    data = os.urandom(CHUNK)
    cid = chunk_id(data)
    r = httpx.put(f"{s3_server.url}/v1/chunks/{cid}", content=data, timeout=60)
    assert r.status_code == 201, r.text
    # A reader that never reads holds its answer (12 MiB of the 16 MiB budget).
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", s3_server.port))
    try:
        slow.sendall(f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        time.sleep(1.0)
        for path, call in ((f"/v1/chunks/{cid}", "GET"), ("/v1/chunks/read", "POST")):
            r = httpx.request(call, f"{s3_server.url}{path}", timeout=30,
                              json={"ids": [cid]} if call == "POST" else None)
            if call == "GET":
                assert r.status_code == 503, r.status_code
                assert r.json()["code"] == "unavailable" and "retry-after" in r.headers
            else:  # a multi-read leaves the chunk out ("-"): the reader asks again
                assert r.status_code == 200 and r.headers["x-ckptd-chunk-sizes"] == "-"
    finally:
        slow.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the closed reader gave its bytes back
        r = httpx.get(f"{s3_server.url}/v1/chunks/{cid}", timeout=30)
        if r.status_code != 503:
            break
        time.sleep(0.2)
    assert r.status_code == 200 and r.content == data
