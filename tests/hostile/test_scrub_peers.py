"""Issue 20, item 1: scrub repairs from peers without lending the server's token.

A job's write token registers a listener as its rank's peer; scrub, finding a
corrupt chunk, may ask only ranks whose own committed manifest names that chunk,
with their job's peer token, never the server's. Another job's listener hears
nothing (not even the chunk id). A real peer chunk server of the job repairs it."""

from __future__ import annotations

import threading
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


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    path = tmp_path / "tokens.json"
    tokens = {job: create_token(path, job, "write")[0] for job in ("alpha", "beta")}
    srv = ServerProcess(store=tmp_path / "store", token=ADMIN,
                        extra_args=["--tokens-file", str(path)])
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
