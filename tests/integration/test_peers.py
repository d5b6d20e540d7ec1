"""The peer chunk server and client (``ckptd.client.peer``) and heartbeats
(``ckptd.client.health.heartbeat``): what a peer serves, what it refuses (unknown chunks,
wrong tokens, buffers being overwritten, more requests than its bound), and that
heartbeats reach a real server and never raise into training."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.health.heartbeat import Heartbeat
from ckptd.client.peer import PeerClient, PeerIndex, PeerServer
from ckptd.errors import ChunkNotFound, ChunkSizeMismatch, Conflict, Unauthorized, Unavailable
from ckptd.hashing import chunk_id
from tests.conftest import ServerProcess, free_port

pytestmark = pytest.mark.timeout(120)


def blobs(n: int, size: int, seed: int = 0) -> dict[str, memoryview]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for _ in range(n):
        data = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).numpy().tobytes()
        out[chunk_id(data)] = memoryview(data)
    return out


def get(url: str, path: str, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}{path}", headers=headers, timeout=10)


@pytest.fixture
def chunks() -> dict[str, memoryview]:
    return blobs(6, 100_000)


def test_a_peer_serves_what_it_published_and_nothing_else(chunks: dict[str, memoryview]) -> None:
    with PeerServer(token="tok", job="j", rank=1) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.port > 0
        cid = next(iter(chunks))
        assert get(server.url, f"/v1/chunks/{cid}", "tok").json()["code"] == "chunk_not_found"
        server.publish(PeerIndex(step=7, chunks=chunks))
        assert server.held_step == 7
        for cid, data in chunks.items():
            resp = get(server.url, f"/v1/chunks/{cid}", "tok")
            assert resp.status_code == 200 and resp.content == bytes(data)
            assert resp.headers["X-Ckptd-Step"] == "7"
        other = "ab" * 32
        assert get(server.url, f"/v1/chunks/{other}", "tok").status_code == 404
        assert get(server.url, "/v1/chunks/not-an-id", "tok").status_code == 404
        info = get(server.url, "/v1/peer", "tok").json()
        assert (info["job"], info["rank"], info["step"], info["chunks"]) == ("j", 1, 7, 6)
        assert info["stats"]["served"] == 6
        # the job's token, and only it
        assert get(server.url, f"/v1/chunks/{cid}").status_code == 401
        resp = get(server.url, f"/v1/chunks/{cid}", "other-token")
        assert resp.status_code == 401 and resp.json()["code"] == "unauthorized"
        assert get(server.url, "/v1/peer").status_code == 401
        assert get(server.url, "/healthz").status_code == 200
        assert server.stats.unauthorized == 3
        server.clear()
        assert server.held_step is None
        assert get(server.url, f"/v1/chunks/{cid}", "tok").status_code == 404


def test_the_client_reads_into_the_callers_buffer_over_kept_alive_connections(
    chunks: dict[str, memoryview],
) -> None:
    with PeerServer(token="tok") as server, PeerClient("tok") as client:
        server.publish(PeerIndex(step=1, chunks=chunks))
        for _ in range(3):
            for cid, data in chunks.items():
                dest = bytearray(len(data))
                assert client.fetch_into(server.url, cid, memoryview(dest)) == len(data)
                assert dest == data
        assert len(client._idle[server.url]) == 1  # one connection, reused
        cid = next(iter(chunks))
        with pytest.raises(ChunkSizeMismatch):
            client.fetch_into(server.url, cid, memoryview(bytearray(10)))
        with pytest.raises(ChunkNotFound):
            client.fetch_into(server.url, "cd" * 32, memoryview(bytearray(10)))
        with pytest.raises(Unauthorized), PeerClient("wrong") as bad:
            bad.fetch_into(server.url, cid, memoryview(bytearray(len(chunks[cid]))))
        # the server restarted on its port: a stale kept-alive connection is retried
        port = server.port
        server.close()
        with pytest.raises(Unavailable) as info:
            client.fetch_into(server.url, cid, memoryview(bytearray(len(chunks[cid]))))
        assert info.value.detail["reason"] in ("unreachable", "disconnected")
        with PeerServer(token="tok", port=port) as again:
            again.publish(PeerIndex(step=1, chunks=chunks))
            dest = bytearray(len(chunks[cid]))
            client.fetch_into(again.url, cid, memoryview(dest))
            assert dest == chunks[cid]


def test_a_buffer_being_overwritten_is_never_served(chunks: dict[str, memoryview]) -> None:
    """The seqlock check runs before and after the copy: a save that starts in
    between makes the answer a 409, not torn bytes."""
    calls = {"n": 0}
    flips_after = {"n": 1}  # valid before the copy, overwritten by the time it is done

    def valid() -> bool:
        calls["n"] += 1
        return calls["n"] <= flips_after["n"]

    # A peer always needs a token (issue 10 #14).
    with PeerServer(token="tok") as server, PeerClient("tok") as client:
        server.publish(PeerIndex(step=3, chunks=chunks, valid=valid))
        cid = next(iter(chunks))
        with pytest.raises(Conflict):
            client.fetch_into(server.url, cid, memoryview(bytearray(len(chunks[cid]))))
        assert calls["n"] == 2 and server.stats.stale == 1
        calls["n"], flips_after["n"] = 0, 0  # already being overwritten when asked
        with pytest.raises(Conflict):
            client.fetch_into(server.url, cid, memoryview(bytearray(len(chunks[cid]))))
        assert calls["n"] == 1 and server.stats.stale == 2 and server.stats.served == 0
        assert server.held_step is None  # an invalid index holds nothing


def test_concurrent_requests_are_bounded(chunks: dict[str, memoryview]) -> None:
    """With every serving slot taken, a request waits ``busy_wait`` and gets 503."""
    release = threading.Event()
    entered = threading.Event()

    def valid() -> bool:
        entered.set()
        release.wait(10)
        return True

    with PeerServer(concurrency=1, busy_wait=0.3, token="tok") as server, \
            PeerClient("tok") as client:
        server.publish(PeerIndex(step=1, chunks=chunks, valid=valid))
        cid = next(iter(chunks))
        results: list[Any] = []

        def first() -> None:
            dest = bytearray(len(chunks[cid]))
            client.fetch_into(server.url, cid, memoryview(dest))
            results.append(bytes(dest))

        t = threading.Thread(target=first)
        t.start()
        assert entered.wait(10)
        with pytest.raises(Unavailable) as info:
            client.fetch_into(server.url, cid, memoryview(bytearray(len(chunks[cid]))))
        assert "busy" in str(info.value) and server.stats.busy == 1
        release.set()
        t.join(10)
        assert results == [bytes(chunks[cid])]


def test_a_peer_bound_to_every_interface_advertises_a_host_name() -> None:
    server = PeerServer(host="0.0.0.0", port=0)
    with server:
        assert "0.0.0.0" not in server.url
    assert PeerServer(advertise_host="node-7", port=1234).url == "http://node-7:1234"


# -- heartbeats ---------------------------------------------------------------------


def test_heartbeats_to_nowhere_never_raise() -> None:
    hb = Heartbeat(f"http://127.0.0.1:{free_port()}", "j", 0, 1, interval=0.05, timeout=0.5)
    hb.note_step(3)
    hb.start()
    time.sleep(0.4)
    hb.stop()
    assert hb.failures >= 2 and hb.beats == 0 and hb.last_reply is None
    assert hb.beat_now() is None  # closed client: logged, not raised


def test_a_broken_health_callback_does_not_stop_heartbeats() -> None:
    def health() -> dict[str, Any]:
        raise RuntimeError("probe broke")

    hb = Heartbeat("http://127.0.0.1:1", "j", 0, 1, health=health)
    assert hb.body()["health"] == {"state": "ok", "reasons": [], "signals": {}}
    hb.stop()


@pytest.fixture
def fast_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A server with a token whose ranks heartbeat every 0.2 s."""
    monkeypatch.setenv("CKPTD_HEARTBEAT_INTERVAL", "0.2")
    srv = ServerProcess(store=tmp_path / "store", token="tok")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def ranks(srv: ServerProcess, job: str) -> dict[int, dict[str, Any]]:
    resp = httpx.get(f"{srv.url}/v1/jobs/{job}/ranks", headers=srv.headers(), timeout=10)
    assert resp.status_code == 200, resp.text
    return {r["rank"]: r for r in resp.json()["ranks"]}


def test_heartbeats_register_the_rank_with_a_real_server(fast_server: ServerProcess) -> None:
    hb = Heartbeat(fast_server.url, "hbjob", 1, 2, token="tok", interval=0.1,
                   peer_url="http://127.0.0.1:9", health=lambda: {
                       "state": "degraded", "reasons": ["hot"], "signals": {"temp": 91}})
    hb.note_step(12)
    reply = hb.beat_now()
    assert reply is not None and reply.interval_s > 0 and reply.rollback_to is None
    hb.set_held_step(10, wake=False)
    hb.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seen = ranks(fast_server, "hbjob").get(1)
        if seen and seen["held_step"] == 10:
            break
        time.sleep(0.05)
    hb.stop()
    assert seen is not None
    assert (seen["step"], seen["held_step"], seen["peer_url"]) == (12, 10, "http://127.0.0.1:9")
    assert seen["state"] == "degraded" and seen["health"]["reasons"] == ["hot"]
    assert hb.rtt_ms is not None and hb.beats >= 2 and hb.failures == 0
    # a wrong token is logged and retried, never raised
    bad = Heartbeat(fast_server.url, "hbjob", 0, 2, token="nope")
    assert bad.beat_now() is None and bad.failures == 1
    bad.stop()


def _peer_of(ckpt: Checkpointer) -> PeerServer:
    server = ckpt.peer_server
    assert server is not None
    return server


def test_a_checkpointer_serves_its_committed_step_and_stops_while_overwriting(
    fast_server: ServerProcess,
) -> None:
    """After a save commits, the rank's pool serves that step's chunks to peers
    and heartbeats say it holds it; a new save makes those buffers unservable at
    once (they are being overwritten), and the next commit serves the new step."""
    state = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(10)}
    with Checkpointer(fast_server.url, "live", token="tok", chunk_size=65536,
                      heartbeat_interval=0.1) as ckpt:
        server = _peer_of(ckpt)
        ckpt.save(1, state).wait(timeout=30)
        assert server.held_step == 1
        # Peers hold the job's peer token from the server, not the server token.
        assert server.token is not None and server.token != "tok"
        client = PeerClient(server.token)
        manifest = json.loads(httpx.get(f"{fast_server.url}/v1/jobs/live/steps/1/ranks/0",
                                        headers=fast_server.headers()).content)
        ids = [c for e in manifest["entries"] for c in e["chunks"]]
        for cid in set(ids):
            dest = bytearray(len(server.index.chunks[cid]))
            client.fetch_into(server.url, cid, memoryview(dest))
            assert chunk_id(dest) == cid
        deadline = time.monotonic() + 10
        while ranks(fast_server, "live").get(0, {}).get("held_step") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ranks(fast_server, "live")[0]["peer_url"] == server.url
        # A new stage bumps the pool's generation: the old index is no longer valid.
        old = server.index
        state["w"].add_(1)
        ckpt.save(2, state).wait(timeout=30)
        assert not old.valid()
        cid = ids[0]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", f"/v1/chunks/{cid}",
                     headers={"Authorization": f"Bearer {server.token}"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        # The first chunk of "w" changed: 404 under the new index (never old bytes).
        assert resp.status in (404, 409), body
        assert server.held_step == 2
        client.close()
