"""How the server answers chunk reads: a GET in one body message straight from the
chunk's file; several chunks of one replica in one request (``POST
/v1/chunks/read``), used by the store tier of a restore."""

from __future__ import annotations

import asyncio
import json
import os
import re
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import blake3
import httpx
import pytest

from ckptd.chunk_reads import CHUNK_SIZES_HEADER, MAX_CHUNK_READ
from ckptd.client.restore.sources import verify_hash
from ckptd.client.transport import HttpTransport, open_transport
from ckptd.errors import ChunkNotFound
from ckptd.server.app import create_app
from ckptd.server.settings import Settings
from tests.conftest import ServerProcess

MiB = 1 << 20


def chunk_id(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


class AsgiCall:
    """One request to the application in this process, every ASGI message it sent
    recorded (the wire a server gives them to is not what these tests look at)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, method: str, path: str, body: bytes = b"",
                       headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if body:
            raw.append((b"content-length", str(len(body)).encode()))
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": raw, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8470),
            "state": self.state,
        }
        await self.app(scope, receive, send)
        return sent

    state: dict[str, Any] = {}


@pytest.fixture
async def asgi(tmp_path: Path) -> AsyncIterator[AsgiCall]:
    """The real application over a local directory store, its lifespan run."""
    app = create_app(Settings(store=str(tmp_path / "store"), port=1))
    call = AsgiCall(app)
    async with app.router.lifespan_context(app) as state:
        call.state = dict(state or {})
        yield call


def body_messages(sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in sent if m["type"] == "http.response.body"]


def whole_body(sent: list[dict[str, Any]]) -> bytes:
    return b"".join(bytes(m.get("body", b"")) for m in body_messages(sent))


async def test_a_chunk_is_sent_in_one_body_message_from_its_map(asgi: AsgiCall) -> None:
    """A 3 MiB chunk goes out as one ``http.response.body`` message holding a view of
    its file, no copy and no more messages (a streamed answer sent one per MiB and
    an empty last one; each send is work on the server's one loop)."""
    data = os.urandom(3 * MiB + 17)
    cid = chunk_id(data)
    put = await asgi("PUT", f"/v1/chunks/{cid}", data)
    assert put[0]["status"] == 201
    sent = await asgi("GET", f"/v1/chunks/{cid}")
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(data)).encode()
    bodies = body_messages(sent)
    assert len(bodies) == 1
    assert not bodies[0].get("more_body", False)
    assert isinstance(bodies[0]["body"], memoryview)  # the map, not a copy of it
    assert bytes(bodies[0]["body"]) == data


async def test_several_chunks_come_back_to_back_with_their_sizes(asgi: AsgiCall) -> None:
    """``POST /v1/chunks/read``: the chunks asked, in order, one body message (a view
    of its map) each; the sizes header marks the one not stored; each chunk sent is
    counted as a GET's is."""
    chunks = [os.urandom(n) for n in (MiB + 3, 5, 2 * MiB)]
    for data in chunks:
        assert (await asgi("PUT", f"/v1/chunks/{chunk_id(data)}", data))[0]["status"] == 201
    absent = chunk_id(b"never stored")
    ids = [chunk_id(chunks[0]), absent, chunk_id(chunks[1]), chunk_id(chunks[2]),
           chunk_id(chunks[0])]
    metrics = asgi.app.state.metrics
    before = metrics.totals.restores
    sent = await asgi("POST", "/v1/chunks/read", json.dumps({"ids": ids}).encode(),
                      {"content-type": "application/json"})
    assert sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[CHUNK_SIZES_HEADER.lower().encode()] == (
        f"{MiB + 3},-,5,{2 * MiB},{MiB + 3}".encode())
    expected = chunks[0] + chunks[1] + chunks[2] + chunks[0]
    assert headers[b"content-length"] == str(len(expected)).encode()
    bodies = body_messages(sent)
    assert len(bodies) == 5  # four chunks and the end
    assert all(isinstance(m["body"], memoryview) for m in bodies[:4])
    assert whole_body(sent) == expected
    assert metrics.totals.restores - before == 4


async def test_a_malformed_id_or_too_many_ids_is_refused(asgi: AsgiCall) -> None:
    def error(sent: list[dict[str, Any]]) -> tuple[int, str]:
        return sent[0]["status"], json.loads(whole_body(sent))["code"]

    bad = await asgi("POST", "/v1/chunks/read", b'{"ids": ["ABC"]}',
                     {"content-type": "application/json"})
    assert error(bad) == (400, "invalid_name")
    many = json.dumps({"ids": [chunk_id(b"x")] * (MAX_CHUNK_READ + 1)}).encode()
    assert error(await asgi("POST", "/v1/chunks/read", many,
                            {"content-type": "application/json"}))[0] == 400


def log_requests(server: ServerProcess, what: str) -> int:
    return len(re.findall(rf'"{what}[^"]* HTTP/1\.1"', server.log()))


async def test_concurrent_store_reads_go_in_one_request_per_lane(
    server: ServerProcess,
) -> None:
    """Thirteen reads asked at once from a real server: two requests (one per lane),
    every chunk verified, the one not stored a ``ChunkNotFound`` of its own."""
    chunks = [os.urandom(4096 + i) for i in range(12)]
    transport = open_transport(server.url)
    assert isinstance(transport, HttpTransport)
    try:
        for data in chunks:
            await transport.put_chunk(chunk_id(data), data)
        reads = transport.chunk_reads(verify_hash)
        assert reads is not None
        absent = chunk_id(b"never stored")
        dests = [memoryview(bytearray(len(d))) for d in chunks]
        results = await asyncio.gather(
            *(reads.read(chunk_id(d), dest) for d, dest in zip(chunks, dests, strict=True)),
            reads.read(absent, memoryview(bytearray(10))), return_exceptions=True)
        assert results[:12] == [chunk_id(d) for d in chunks]
        assert [bytes(d) for d in dests] == chunks
        assert isinstance(results[12], ChunkNotFound)
        assert reads.requests == 2
        reads.close()
    finally:
        await transport.close()
    assert log_requests(server, "POST /v1/chunks/read") == 2
    assert log_requests(server, "GET /v1/chunks/") == 0


def test_dcp_load_over_http_reads_its_chunks_in_two_requests(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dcp.load`` through the Reader: the store tier asks for the sixteen chunks of
    a step in two requests (one per lane: the Reader has them all in flight at
    once), never one GET each, and the load is bitwise."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptd.client.dcp import Reader, Writer

    monkeypatch.setenv("CKPTD_CACHE_DIR", "")
    monkeypatch.setenv("CKPTD_RESTORE_CONCURRENCY", "8")  # the Reader: twice that
    state = {f"w{i}": torch.randn(64 * 1024) for i in range(4)}  # 256 KiB each
    chunk = 64 * 1024
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=Writer(server.url, "batched", 1, chunk_size=chunk))
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=Reader(server.url, "batched", 1), no_dist=True)
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    assert sum(v.numel() * v.element_size() for v in state.values()) // chunk == 16
    assert log_requests(server, "GET /v1/chunks/") == 0
    assert log_requests(server, "POST /v1/chunks/read") == 2



def test_a_multi_chunk_answer_holds_little_memory_from_a_store_of_no_files(
    tmp_path: Path,
) -> None:
    """From a store whose chunks are not files here (memory://, S3), one answer
    reads at most READ_HOLD into memory; the rest say "-" and the reader asks for
    them again (found by review: 64 chunks of 4 MiB were held at once)."""
    from ckptd.server.routes.chunks import READ_HOLD

    srv = ServerProcess(store="memory://", log_dir=tmp_path)
    srv.start()
    try:
        blobs = [bytes([k]) * (4 << 20) for k in range(8)]  # 32 MiB, over READ_HOLD
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for b in blobs:
                assert c.put(f"/v1/chunks/{chunk_id(b)}", content=b).status_code == 201
            r = c.post("/v1/chunks/read", json={"ids": [chunk_id(b) for b in blobs]})
        assert r.status_code == 200
        sizes = r.headers[CHUNK_SIZES_HEADER].split(",")
        sent = [s for s in sizes if s != "-"]
        assert 0 < sum(map(int, sent)) <= READ_HOLD + (4 << 20)
        assert "-" in sizes  # the rest are asked for again
        assert len(r.content) == sum(map(int, sent))
    finally:
        srv.stop()
