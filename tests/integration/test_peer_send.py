"""A peer sends a chunk straight from its pool (issue 21, item 2): no copy of its
own, the kernel's ``sendmsg`` copy the only one, and the pool's seqlock checked
after the kernel took the bytes, in a trailer the client reads before it keeps
them. A client that reads no trailers gets the copied-out answer as before."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from ckptd.client.peer import PeerClient, PeerIndex, PeerServer
from ckptd.errors import ChunkSizeMismatch, Conflict, MethodNotAllowed, from_json, http_status
from ckptd.hashing import chunk_id

pytestmark = pytest.mark.timeout(60)

DATA = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and a bit
CID = chunk_id(DATA)


def fetch(client: PeerClient, url: str, n: int = len(DATA), cid: str = CID) -> bytes:
    dest = bytearray(n)
    client.fetch_into(url, cid, memoryview(dest))
    return bytes(dest)


def test_a_chunk_goes_out_straight_from_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = {"n": 0}
    with PeerServer(token="t") as server, PeerClient("t") as client:
        server.publish(PeerIndex(step=2, chunks={CID: memoryview(DATA)}))
        real = server._take_scratch

        def counted(n: int) -> bytearray:
            copies["n"] += 1
            out: bytearray = real(n)
            return out

        monkeypatch.setattr(server, "_take_scratch", counted)
        for _ in range(3):
            assert fetch(client, server.url) == DATA
        assert copies["n"] == 0 and server.stats.served == 3
        # A client that reads no trailers (httpx) gets the bytes copied out first.
        resp = httpx.get(f"{server.url}/v1/chunks/{CID}", headers={"Authorization": "Bearer t"})
        assert resp.status_code == 200 and resp.content == DATA
        assert "transfer-encoding" not in resp.headers and copies["n"] == 1


def test_bytes_overwritten_while_they_were_sent_are_refused() -> None:
    """The pool is valid when the answer starts and overwritten by the time the
    kernel has the bytes: the client got every byte, torn, and must not keep them."""
    buf = bytearray(DATA)
    calls = {"n": 0}

    def valid() -> bool:
        calls["n"] += 1
        if calls["n"] == 2:  # after the send: a save overwrote the buffer meanwhile
            buf[:4] = b"torn"
            return False
        return calls["n"] < 2

    with PeerServer(token="t") as server, PeerClient("t") as client:
        server.publish(PeerIndex(step=2, chunks={CID: memoryview(buf)}, valid=valid))
        with pytest.raises(Conflict):
            fetch(client, server.url)
        assert server.stats.stale == 1 and server.stats.served == 0
        # The connection was read to its end and stays usable: the next answer on it
        # is framed right (what the pool holds now, whole).
        assert len(client._idle[server.url]) == 1
        kept = client._idle[server.url][0]
        calls["n"] = -10  # valid again, before and after
        assert fetch(client, server.url) == bytes(buf)
        assert client._idle[server.url] == [kept] and server.stats.served == 1


@pytest.fixture
def raw_peer() -> Iterator[tuple[str, list[bytes]]]:
    """A socket that answers each request with the next canned answer."""
    answers: list[bytes] = []
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                while answers:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        more = conn.recv(4096)
                        if not more:
                            break
                        head += more
                    if not head:
                        break
                    conn.sendall(answers.pop(0))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", answers
    finally:
        stop.set()
        t.join(5)
        srv.close()


def chunked(pieces: list[bytes], trailer: bytes = b"X-Ckptd-Valid: 1\r\n") -> bytes:
    body = b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" for p in pieces)
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n"
            + trailer + b"\r\n")


def test_the_client_reads_any_chunked_answer_into_the_buffer(
        raw_peer: tuple[str, list[bytes]]) -> None:
    url, answers = raw_peer
    answers += [
        chunked([DATA[:1000], DATA[1000:5000], DATA[5000:]]),  # pieces
        chunked([DATA], trailer=b""),  # no validity said: kept (the hash decides)
        chunked([DATA, b"more"]),  # longer than the chunk
    ]
    with PeerClient() as client:
        assert fetch(client, url) == DATA
        assert fetch(client, url) == DATA
        with pytest.raises(ChunkSizeMismatch):
            fetch(client, url)
    answers += [chunked([DATA[:10]])]  # shorter than the chunk
    with PeerClient() as client, pytest.raises(ChunkSizeMismatch):
        fetch(client, url)


def test_an_http_1_0_client_gets_a_length_never_a_chunked_body() -> None:
    """(Found by review.) HTTP/1.0 knows no chunked body (RFC 9112, 6.1): a 1.0
    request gets the copied-out answer with its length, TE: trailers or not."""
    with PeerServer(token="t") as server:
        server.publish(PeerIndex(step=2, chunks={CID: memoryview(DATA)}))
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"GET /v1/chunks/{CID} HTTP/1.0\r\nTE: trailers\r\n"
                      "Authorization: Bearer t\r\n\r\n".encode())
            answer = bytearray()
            while more := s.recv(1 << 20):  # (1.0: the peer closes after its answer)
                answer += more
        head, _, body = bytes(answer).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding" not in head.lower()
        assert f"content-length: {len(DATA)}".encode() in head.lower()
        assert body == DATA


def test_a_method_a_peer_does_not_take_is_405_method_not_allowed() -> None:
    """The code of an answer is the one its status stands for (``HTTP_STATUS``):
    a peer's 405 said ``invalid_request``, a 400's code."""
    with PeerServer(token="t") as server:
        server.publish(PeerIndex(step=2, chunks={CID: memoryview(DATA)}))
        r = httpx.put(f"{server.url}/v1/chunks/{CID}", content=b"x",
                      headers={"Authorization": "Bearer t"})
        assert r.status_code == 405 and r.headers["allow"] == "GET"
        err = from_json(r.json())
        assert isinstance(err, MethodNotAllowed) and http_status(err.code) == 405, r.text
