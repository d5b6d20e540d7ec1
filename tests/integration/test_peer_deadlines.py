"""Chunk requests to a peer end on time: a peer that trickles its answer fails the
request within its deadline, and a restore whose deadline passes leaves no thread
receiving into its buffers (found by review). The peers are plain loopback
sockets that answer slowly; every loop here is bounded."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import blake3
import pytest
import torch

from ckptd.client.loop import EventLoopThread
from ckptd.client.peer import PeerClient
from ckptd.client.restore.fetch import ChunkFetcher, WantedChunks
from ckptd.client.restore.sources import PeerSource
from ckptd.errors import Timeout, Unavailable


def _peer(answer: Callable[[socket.socket], None]) -> str:
    """A one-request peer on loopback that answers with ``answer``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(30)

    def serve() -> None:
        try:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                answer(conn)
        except OSError:
            pass  # the client went away: done
        finally:
            srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}"


def test_a_peer_that_trickles_its_answer_times_out() -> None:
    n = 64 << 10

    def trickle(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
        for _ in range(40):  # a byte every 0.2 s: each read sees data, none ends
            conn.sendall(b"x")
            time.sleep(0.2)

    url = _peer(trickle)
    client = PeerClient(None, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as info:
        client.fetch_into(url, "0" * 64, memoryview(bytearray(n)))
    assert info.value.detail.get("reason") == "timeout"
    assert time.monotonic() - t0 < 4.0  # timeout + 64 KiB at the slowest rate, + a read
    client.close()


def test_a_restore_deadline_ends_the_peer_reads_under_way() -> None:
    body = bytes(range(256)) * 4096  # 1 MiB
    cid = blake3.blake3(body).hexdigest()

    def slow(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        conn.sendall(body[: len(body) // 2])
        time.sleep(1.0)  # slow, not dead: within the peer timeout
        conn.sendall(body[len(body) // 2 :])
        time.sleep(0.5)

    url = _peer(slow)
    target = torch.zeros(len(body), dtype=torch.uint8)
    wanted = WantedChunks()
    wanted.add(cid, memoryview(target.numpy()), "t", in_target=True)
    source = PeerSource({cid: [url]}, PeerClient(None, timeout=5.0))
    fetcher = ChunkFetcher([source], concurrency=2)
    loop = EventLoopThread("peer-deadline")
    try:
        with pytest.raises(Timeout):
            loop.run(fetcher.locate_all(wanted, atomic=False), 0.3)
        source.close()
        at_return = int(target.count_nonzero())
        time.sleep(1.5)
        assert int(target.count_nonzero()) == at_return, "written after the deadline"
    finally:
        loop.stop()
