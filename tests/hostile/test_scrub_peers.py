"""Issue 20, item 1: scrub repairs from peers without lending the server's token.

A job's write token registers a listener as its rank's peer; scrub, finding a
corrupt chunk, may ask only ranks whose own committed manifest names that chunk,
with their job's peer token, never the server's. Another job's listener hears
nothing (not even the chunk id). A real peer chunk server of the job repairs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.peer import PeerIndex, PeerServer
from ckptd.hashing import chunk_id
from ckptd.tokens import create_token
from tests.conftest import ServerProcess

ADMIN = "the-server-token"


class Listener:
    """An HTTP listener that records every request's path and Authorization, and
    answers 200 with bytes that are no chunk."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                seen.append((self.path, self.headers.get("Authorization", "")))
                body = b"not the chunk you asked for"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Trickle(Listener):
    """A "peer" that answers 200 for a whole chunk and sends a byte every 0.2 s:
    each read is quick, the chunk never ends."""

    def __init__(self) -> None:  # (no super().__init__: another handler)
        self.seen = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                seen.append((self.path, self.headers.get("Authorization", "")))
                self.send_response(200)
                self.send_header("Content-Length", str(4 << 20))
                self.end_headers()
                try:
                    for _ in range(3000):  # 10 minutes at most
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass  # the server gave up on it

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    path = tmp_path / "tokens.json"
    tokens = {job: create_token(path, job, "write")[0] for job in ("alpha", "beta")}
    srv = ServerProcess(store=tmp_path / "store", token=ADMIN,
                        extra_args=["--tokens-file", str(path)],
                        env={"CKPTD_SCRUB_PEER_TIMEOUT": "3"})
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def beat(srv: ServerProcess, job: str, token: str, peer_url: str) -> str:
    """A heartbeat of rank 0 serving step 1 at ``peer_url``; the job's peer token."""
    r = httpx.post(f"{srv.url}/v1/jobs/{job}/ranks/0/heartbeat", timeout=10,
                   headers={"Authorization": f"Bearer {token}"},
                   json={"world_size": 1, "peer_url": peer_url, "held_step": 1})
    assert r.status_code == 200, r.text
    assert r.json()["peer_url_refused"] is None
    return str(r.json()["peer_token"])


def scrub(srv: ServerProcess) -> dict[str, list[str]]:
    r = httpx.post(f"{srv.url}/v1/scrub", headers=srv.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_scrub_never_sends_the_server_token_to_a_tenant_listener(
    tenants: tuple[ServerProcess, dict[str, str]],
) -> None:
    srv, tokens = tenants
    with Checkpointer(srv.url, "alpha", token=tokens["alpha"], chunk_size=4096,
                      serve_peers=False, heartbeat_interval=0) as ckpt:
        state = {"w": torch.arange(2048, dtype=torch.float32)}
        assert ckpt.save(1, state).wait(timeout=60).state == "committed"
    path = next(p for p in (Path(srv.store) / "chunks").rglob("*") if p.is_file())
    cid, good = path.name, path.read_bytes()
    bad = bytearray(good)
    bad[7] ^= 0x01
    path.write_bytes(bytes(bad))

    own, other = Listener(), Listener()
    try:
        alpha_peer = beat(srv, "alpha", tokens["alpha"], own.url)
        beat(srv, "beta", tokens["beta"], other.url)
        report = scrub(srv)
        assert cid in report["corrupt"] and cid not in report["repaired"]
        everything = own.seen + other.seen
        assert not any(ADMIN in auth for _, auth in everything), everything
        # beta's manifests name no such chunk: its listener never hears the id.
        assert other.seen == []
        # alpha's own rank holds it: asked with alpha's peer token, for that chunk.
        assert own.seen == [(f"/v1/chunks/{cid}", f"Bearer {alpha_peer}")]
    finally:
        own.close()
        other.close()

    # A real peer chunk server of alpha holding the chunk repairs it.
    with PeerServer(host="127.0.0.1", port=0) as peer:
        peer.set_token(alpha_peer)
        peer.publish(PeerIndex(step=1, chunks={cid: memoryview(good)}))
        assert chunk_id(good) == cid
        beat(srv, "alpha", tokens["alpha"], peer.url)
        report = scrub(srv)
        assert report["repaired"] == [cid], report
    assert path.read_bytes() == good


def test_a_peer_that_trickles_does_not_hold_the_scrub(
    tenants: tuple[ServerProcess, dict[str, str]],
) -> None:
    """A tenant's listener sending a byte now and then kept every read within its
    timeout and the scrub of the whole store waiting on it, for good."""
    srv, tokens = tenants
    with Checkpointer(srv.url, "alpha", token=tokens["alpha"], chunk_size=4096,
                      serve_peers=False, heartbeat_interval=0) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(1024)}).wait(timeout=60).state == "committed"
    path = next(p for p in (Path(srv.store) / "chunks").rglob("*") if p.is_file())
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    slow = Trickle()
    try:
        beat(srv, "alpha", tokens["alpha"], slow.url)
        started = time.monotonic()
        report = scrub(srv)  # (60 s for the answer)
        assert path.name in report["corrupt"] and report["repaired"] == []
        assert len(slow.seen) == 1 and time.monotonic() - started < 30
    finally:
        slow.close()
