"""Chunk bodies in the server: one buffer per upload, reused by later uploads."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from ckptd import knobs
from ckptd.hashing import chunk_id
from ckptd.server.bodies import BodyBuffers

if TYPE_CHECKING:
    from tests.conftest import ServerProcess


# The tests that need only a running server share one (``shared_server``,
# tests/integration/conftest.py), and so its store: each uploads bytes of its own
# (random); a test that needs other settings, or a chunk any test could store (the
# empty one), has a server of its own.


@pytest.fixture
def client(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the module's shared server."""
    with httpx.Client(base_url=shared_server.url, headers=shared_server.headers(),
                      timeout=30.0) as c:
        yield c


async def test_concurrent_uploads_of_one_size_each_store_their_own_bytes(
    shared_server: ServerProcess,
) -> None:
    # Same-size bodies share reused buffers: a buffer handed to the next upload
    # while a store still wrote it would store (or serve) another chunk's bytes.
    size = 2 * knobs.MiB
    bodies = [os.urandom(size) for _ in range(24)]
    ids = [chunk_id(b) for b in bodies]
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(
        base_url=shared_server.url, headers=shared_server.headers(), timeout=60.0, limits=limits
    ) as c:
        for _ in range(2):  # the second round finds the first round's buffers idle
            answers = await asyncio.gather(
                *(c.put(f"/v1/chunks/{cid}", content=b) for cid, b in zip(ids, bodies, strict=True))
            )
            assert all(r.status_code in (200, 201) for r in answers), answers
        for cid, body in zip(ids, bodies, strict=True):
            r = await c.get(f"/v1/chunks/{cid}")
            assert r.status_code == 200, r.text
            assert r.content == body


def test_refused_upload_leaves_later_ones_of_its_size_intact(client: httpx.Client) -> None:
    size = knobs.MiB + 3
    bad = os.urandom(size)
    r = client.put(f"/v1/chunks/{chunk_id(os.urandom(size))}", content=bad)
    assert r.status_code == 422
    good = os.urandom(size)
    cid = chunk_id(good)
    assert client.put(f"/v1/chunks/{cid}", content=good).status_code == 201
    assert client.get(f"/v1/chunks/{cid}").content == good


def test_chunked_upload_longer_than_the_first_buffer(client: httpx.Client) -> None:
    data = os.urandom(5 * knobs.MiB + 11)  # grows the buffer several times
    cid = chunk_id(data)

    def pieces() -> Iterator[bytes]:
        for a in range(0, len(data), 300_000):
            yield data[a : a + 300_000]

    assert client.put(f"/v1/chunks/{cid}", content=pieces()).status_code == 201
    assert client.get(f"/v1/chunks/{cid}").content == data


async def test_body_buffers_reuse_by_exact_size_within_their_bound() -> None:
    mib = knobs.MiB
    buffers = BodyBuffers(keep=3 * mib, idle_s=60.0)
    first = buffers.take(mib)
    buffers.give(first)
    assert buffers.take(mib) is first
    assert buffers.take(mib) is not first  # taken: not handed out twice
    buffers.give(first)
    assert len(buffers.take(mib + 1)) == mib + 1  # no other size is handed out
    for _ in range(4):
        buffers.give(mmap.mmap(-1, mib, flags=mmap.MAP_PRIVATE))
    assert buffers.idle_bytes == 3 * mib  # the oldest went
    buffers.give(bytearray(1024))  # small ones cost little to allocate: not kept
    buffers.give(mmap.mmap(-1, 4 * mib))  # over the bound: not kept
    assert buffers.idle_bytes == 3 * mib
    # A large one is a page-aligned map (the store writes it around the page cache);
    # a bytearray given back (a grown body's) is not kept, so none is handed out.
    buffers.clear()
    buffers.give(bytearray(mib))
    assert buffers.idle_bytes == 0
    assert isinstance(buffers.take(mib), mmap.mmap) and isinstance(buffers.take(100), bytearray)


async def test_body_buffers_go_once_uploads_stop() -> None:
    # Margins of 0.4 s each way: the loop of a loaded machine runs late.
    buffers = BodyBuffers(keep=4 * knobs.MiB, idle_s=1.0)
    t0 = time.monotonic()
    buffers.give(mmap.mmap(-1, knobs.MiB, flags=mmap.MAP_PRIVATE))
    await asyncio.sleep(0.6)
    buffers.give(mmap.mmap(-1, knobs.MiB, flags=mmap.MAP_PRIVATE))  # pushes the expiry back
    await asyncio.sleep(max(0.0, t0 + 1.2 - time.monotonic()))
    assert buffers.idle_bytes == 2 * knobs.MiB  # past the first give's second
    for _ in range(100):  # bounded: 5 s
        if not buffers.idle_bytes:
            break
        await asyncio.sleep(0.05)
    assert buffers.idle_bytes == 0


# -- uploads received straight into their buffers (ckptd.server.ingest) ---------------


@pytest.fixture
def quick_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose stalled bodies time out after 2 s."""
    from tests.conftest import ServerProcess

    srv = ServerProcess(store=tmp_path / "store", env={"CKPTD_BODY_TIMEOUT": "2"})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class Wire:
    """One raw HTTP/1.1 connection: bytes out as given, answers parsed as they come."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.pending = b""

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        more = self.sock.recv(1 << 20)
        if not more:
            raise ConnectionError("closed")
        self.pending += more

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.pending:
            self._more()
        head, _, self.pending = self.pending.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in lines[1:])}
        size = int(headers.get("content-length", "0"))
        while len(self.pending) < size:
            self._more()
        body, self.pending = self.pending[:size], self.pending[size:]
        return int(lines[0].split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server closed the connection (within the socket's timeout)."""
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True


def _put(cid: str, data: bytes, extra: str = "") -> bytes:
    return (f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(data)}\r\n"
            f"{extra}\r\n").encode() + data


def test_pipelined_uploads_and_reads_are_answered_in_order(shared_server: ServerProcess) -> None:
    good, other = os.urandom(3 * knobs.MiB), os.urandom(70_000)
    bad = os.urandom(knobs.MiB)
    with Wire(shared_server.port) as w:
        w.send(_put(chunk_id(good), good) + _put(chunk_id(other), bad)
               + _put(chunk_id(other), other)
               + f"GET /v1/chunks/{chunk_id(good)} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        assert w.answer()[0] == 201
        status, _, body = w.answer()
        assert status == 422 and json.loads(body)["code"] == "chunk_hash_mismatch", body
        status, _, body = w.answer()
        assert status == 201 and json.loads(body) == {
            "id": chunk_id(other), "size": len(other), "created": True}
        status, _, body = w.answer()
        assert status == 200 and body == good


def test_an_upload_in_small_pieces_with_pauses_is_stored(shared_server: ServerProcess) -> None:
    data = os.urandom(knobs.MiB + 5)
    message = _put(chunk_id(data), data)
    with Wire(shared_server.port) as w:
        # The head split mid-line, the body in pieces that do not follow the head's.
        for start in (0, 7, 40, 90, 5000, 400_000):
            end = {0: 7, 7: 40, 40: 90, 90: 5000, 5000: 400_000}.get(start, len(message))
            w.send(message[start:end])
            time.sleep(0.05)
        assert w.answer()[0] == 201
        w.send(_put(chunk_id(data), data))  # the same connection, the next request
        status, _, body = w.answer()
        assert status == 200 and json.loads(body)["created"] is False
    r = httpx.get(f"{shared_server.url}/v1/chunks/{chunk_id(data)}", timeout=30)
    assert r.content == data


def test_expect_100_continue_then_the_body(shared_server: ServerProcess) -> None:
    data = os.urandom(2 * knobs.MiB)
    with Wire(shared_server.port) as w:
        w.send(_put(chunk_id(data), b"", "Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", f"Content-Length: {len(data)}".encode()))
        status, _, _ = w.answer()
        assert status == 100
        w.send(data)
        assert w.answer()[0] == 201


def test_an_empty_chunk_is_stored(server: ServerProcess) -> None:
    # (its own server: any test could store the empty chunk, found then, not created)
    with Wire(server.port) as w:
        w.send(_put(chunk_id(b""), b""))
        assert w.answer()[0] == 201
    assert httpx.get(f"{server.url}/v1/chunks/{chunk_id(b'')}", timeout=10).content == b""


def test_an_upload_with_neither_a_length_nor_chunks_is_411(shared_server: ServerProcess) -> None:
    """(found by a probe: such a PUT has no body, and was answered 422, the empty
    body's hash not the id's; the sender forgot its Content-Length)"""
    logged = len(shared_server.log())  # (its log from here: the server is shared)
    data = os.urandom(1000)
    cid = chunk_id(data)
    with Wire(shared_server.port) as w:
        w.send(f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        status, _, body = w.answer()
        assert status == 411, body
        error = json.loads(body)
        assert error["code"] == "length_required"
        assert "Content-Length" in error["message"] and "\n" not in error["message"]
        w.send(_put(cid, data))  # the connection goes on: nothing was left unread
        assert w.answer()[0] == 201
    # Chunked transfer encoding needs no length.
    other = os.urandom(1000)
    r = httpx.put(f"{shared_server.url}/v1/chunks/{chunk_id(other)}", content=iter([other]),
                  timeout=30)
    assert r.status_code == 201, r.text
    assert "Traceback" not in shared_server.log()[logged:]

def test_a_short_body_stores_nothing(shared_server: ServerProcess) -> None:
    logged = len(shared_server.log())  # (its log from here: the server is shared)
    data = os.urandom(2 * knobs.MiB)
    cid = chunk_id(data)
    with Wire(shared_server.port) as w:
        w.send(_put(cid, data)[: -knobs.MiB])  # then the client goes away
    time.sleep(0.5)
    assert httpx.head(f"{shared_server.url}/v1/chunks/{cid}", timeout=10).status_code == 404
    # The server goes on: the whole body is stored.
    r = httpx.put(f"{shared_server.url}/v1/chunks/{cid}", content=data, timeout=30)
    assert r.status_code == 201
    assert "Traceback" not in shared_server.log()[logged:]


def test_a_stalled_body_times_out_and_frees_its_connection(quick_server: ServerProcess) -> None:
    data = os.urandom(knobs.MiB)
    cid = chunk_id(data)
    with Wire(quick_server.port) as w:
        t0 = time.monotonic()
        w.send(_put(cid, data)[: -1000])
        status, headers, body = w.answer()
        waited = time.monotonic() - t0
        assert status == 408 and json.loads(body)["code"] == "body_timeout", body
        assert headers.get("connection") == "close"
        assert 1.5 < waited < 10, waited
        assert w.closed()
    assert httpx.head(f"{quick_server.url}/v1/chunks/{cid}", timeout=10).status_code == 404


@pytest.fixture(scope="module")
def glob_token_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, str]]:
    """A server with its own token and a write token for the jobs ``alp*``, shared by
    the module's tests that take it (each uploads bytes of its own, random)."""
    from ckptd.tokens import create_token
    from tests.conftest import ServerProcess

    folder = tmp_path_factory.mktemp("glob-token-server")
    tokens_file = folder / "tokens.json"
    token = create_token(tokens_file, "alp*", "write")[0]
    srv = ServerProcess(store=folder / "store", token="root-token",
                        extra_args=["--tokens-file", str(tokens_file)])
    srv.start()
    try:
        yield srv, token
    finally:
        srv.stop()


@pytest.mark.parametrize(("auth", "status", "code"), [
    ("", 401, "unauthorized"),
    ("Authorization: Bearer wrong\r\n", 401, "unauthorized"),
    ("Authorization: Bearer {glob}\r\n", 400, "invalid_request"),  # which job?
    ("Authorization: Bearer {glob}\r\nX-Ckptd-Job: beta\r\n", 403, "forbidden"),
    ("Authorization: Bearer {glob}\r\nX-Ckptd-Job: ../x\r\n", 400, "invalid_name"),
])
def test_a_refused_upload_is_answered_before_its_body(
    glob_token_server: tuple[ServerProcess, str], auth: str, status: int, code: str,
) -> None:
    srv, glob = glob_token_server
    data = os.urandom(8 * knobs.MiB)
    head = _put(chunk_id(data), b"", auth.format(glob=glob)).replace(
        b"Content-Length: 0", f"Content-Length: {len(data)}".encode())
    with Wire(srv.port) as w:
        w.send(head)  # and no byte of the body
        got, headers, body = w.answer()
        assert (got, json.loads(body)["code"]) == (status, code), body
        assert headers.get("connection") == "close" and w.closed()
        if status == 401:
            assert headers.get("www-authenticate") == "Bearer"
    with Wire(srv.port) as w:
        w.send(_put(chunk_id(data), data, f"Authorization: Bearer {glob}\r\n"
                    "X-Ckptd-Job: alpha\r\n"))
        assert w.answer()[0] == 201


@pytest.mark.parametrize("via", ["", "?via=route"])
def test_both_paths_answer_uploads_and_reads_alike(glob_token_server: tuple[ServerProcess, str],
                                        via: str) -> None:
    # "?via=route" is not taken straight into a buffer: FastAPI's route answers it.
    srv, glob = glob_token_server
    data = os.urandom(knobs.MiB + 1)
    cid = chunk_id(data)
    answers = []
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for headers, body in [
            ({}, data),
            ({"Authorization": f"Bearer {glob}"}, data),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "beta"}, data),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpha"}, data[:-1] + b"!"),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpha"}, data),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpha"}, data),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpine"}, data),
            ({"Authorization": "Bearer root-token"}, data),
        ]:
            r = c.put(f"/v1/chunks/{cid}{via}", content=body, headers=headers)
            doc = r.json()
            answers.append((r.status_code, doc.get("code", doc.get("created"))))
        reads = []
        for headers, read in [
            ({}, cid),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "beta"}, cid),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpha"}, cid),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpha"}, chunk_id(b"none")),
            ({"Authorization": f"Bearer {glob}", "X-Ckptd-Job": "alpaca"}, cid),  # not its
            ({"Authorization": "Bearer root-token"}, cid),
        ]:
            r = c.get(f"/v1/chunks/{read}{via}", headers=headers)
            reads.append((r.status_code, r.content == data or r.json()["code"]))
    assert answers == [
        (401, "unauthorized"), (400, "invalid_request"), (403, "forbidden"),
        (422, "chunk_hash_mismatch"),
        (201, True), (200, False),  # alpha stored it, then knew it
        (201, True),  # alpine is not told that alpha had it
        (200, False),  # the server's token sees the store as it is
    ]
    assert reads == [(401, "unauthorized"), (403, "forbidden"), (200, True),
                     (404, "chunk_not_found"), (404, "chunk_not_found"), (200, True)]


async def test_uploads_with_a_length_and_reads_take_the_lean_route(
    tmp_path: Path,
) -> None:
    import uvicorn
    from starlette.types import Receive, Scope, Send

    from ckptd.server.app import create_app
    from ckptd.server.ingest import connection_protocol
    from ckptd.server.routes.chunks import direct_chunk_app
    from ckptd.server.settings import Settings

    app = create_app(Settings(store=str(tmp_path / "store")))
    direct = direct_chunk_app(app)
    taken: list[str] = []

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        taken.append(f"{scope['method']} {scope['path']}")
        await direct(scope, receive, send)

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            http=connection_protocol(10.0, 100, counted))  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(500):  # bounded
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        bodies = [os.urandom(3 * knobs.MiB) for _ in range(4)] + [os.urandom(17 * knobs.MiB)]
        ids = [chunk_id(b) for b in bodies]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            assert (await c.put(f"/v1/chunks/{ids[0]}", content=bodies[0])).status_code == 201
            assert (await c.put(f"/v1/chunks/{ids[1]}?x=1", content=bodies[1])).status_code == 201

            async def pieces() -> AsyncIterator[bytes]:
                yield bodies[2]

            # Chunked transfer encoding, and a body over PREALLOCATE: the route.
            assert (await c.put(f"/v1/chunks/{ids[2]}", content=pieces())).status_code == 201
            assert (await c.put(f"/v1/chunks/{ids[4]}", content=bodies[4])).status_code == 201
            assert (await c.put(f"/v1/chunks/{ids[3]}", content=bodies[3])).status_code == 201
            for cid, body in zip(ids, bodies, strict=True):
                assert (await c.get(f"/v1/chunks/{cid}")).content == body
            assert (await c.get(f"/v1/chunks/{ids[0]}?x=1")).content == bodies[0]
            assert (await c.head(f"/v1/chunks/{ids[0]}")).status_code == 200
        assert taken == [f"PUT /v1/chunks/{ids[0]}", f"PUT /v1/chunks/{ids[3]}",
                         *(f"GET /v1/chunks/{cid}" for cid in ids)]
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
