"""Issue 10, item 14: the peer chunk server inside a training process.

It always authenticates (the job's peer token from the server; nothing is
served before one is set), advertises an address peers can reach (never
``localhost``), and serves from a fixed pool of threads with read deadlines:
hundreds of half-sent requests neither add threads to the training process nor
keep a real peer out for longer than the head timeout."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time

import pytest

from ckptd.client.peer import PeerClient, PeerIndex, PeerServer, route_address
from ckptd.errors import Unauthorized
from ckptd.hashing import chunk_id

DATA = b"a chunk of the pool" * 1000
CID = chunk_id(DATA)


def index() -> PeerIndex:
    return PeerIndex(step=1, chunks={CID: memoryview(DATA)})


def fetch(client: PeerClient, server: PeerServer) -> bytes:
    dest = bytearray(len(DATA))
    client.fetch_into(server.url, CID, memoryview(dest))
    return bytes(dest)


def test_a_peer_without_a_token_serves_nothing() -> None:
    with PeerServer() as server, PeerClient() as anonymous, PeerClient("job-peer-token") as peer:
        server.publish(index())
        with pytest.raises(Unauthorized):
            fetch(anonymous, server)
        with pytest.raises(Unauthorized):
            fetch(peer, server)  # no token set yet: nobody is let in
        server.set_token("job-peer-token")
        assert fetch(peer, server) == DATA
        with pytest.raises(Unauthorized):
            fetch(anonymous, server)
        server.set_token("next-peer-token")  # the server restarted: a new token
        assert fetch(peer, server) == DATA  # the one before still counts
        assert server.stats.unauthorized == 3


def test_a_peer_bound_to_every_interface_advertises_a_routable_address() -> None:
    with PeerServer(host="0.0.0.0", port=0, token="t") as server:
        host = server.url.split("//", 1)[1].rsplit(":", 1)[0]
        # An IP address (not a name such as getfqdn()'s "localhost"), and a real one.
        ipaddress.ip_address(host.strip("[]"))
        assert host not in ("0.0.0.0", "[::]")
    # Toward a server on loopback, the route is loopback: what the server sees.
    assert route_address("http://127.0.0.1:8470") == "127.0.0.1"


@pytest.mark.slow
def test_half_sent_requests_add_no_threads_and_time_out() -> None:
    head_timeout = 1.0
    server = PeerServer(token="tok", head_timeout=head_timeout, concurrency=2).start()
    held: list[socket.socket] = []
    try:
        server.publish(index())
        threads_before = threading.active_count()
        host, port = "127.0.0.1", server.port
        for n in range(300):
            s = socket.create_connection((host, port), timeout=5)
            if n % 2:
                s.sendall(b"GET /v1/chunks/")  # half a request line, never finished
            held.append(s)
        time.sleep(0.2)
        assert threading.active_count() <= threads_before  # a fixed pool, started already
        # Within a bound every half-sent connection is dropped (the head timeout,
        # or at once when the queue was full) and a real peer gets through.
        deadline = time.monotonic() + head_timeout * 300 / 6 + 10
        with PeerClient("tok", timeout=5) as peer:
            while True:
                try:
                    assert fetch(peer, server) == DATA
                    break
                except Exception:
                    assert time.monotonic() < deadline, "a real peer never got through"
                    time.sleep(0.2)
        for s in held:  # every one closed by the peer (none left holding a worker)
            s.settimeout(head_timeout * 300 / 6 + 10)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1024) == b""
        assert threading.active_count() <= threads_before
    finally:
        for s in held:
            s.close()
        server.close()
