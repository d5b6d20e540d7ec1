"""A replica that hangs in the middle of an answer's body (stopped once its headers
came) holds a restore for seconds, not a request timeout: the read that waits has
the replica probed, the probe marks it down, the read is given up and the chunk is
fetched from the next replica, verified as every chunk is; through the transport's
httpx client (https://) and over its raw chunk reads (http://) alike."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.peer.client import PeerClient
from ckptd.client.transport import HttpTransport
from tests.cluster.conftest import Replica

CHUNK = 32 << 20  # (far more than loopback's socket buffers hold of a body unread)


def _stop(replicas: dict[str, Replica], url: str, stopped: list[str]) -> None:
    """SIGSTOPs the replica at ``url``: hung, its kernel still taking bytes."""
    proc = replicas[url].proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    stopped.append(url)


def _left_within_seconds(ckpt: Checkpointer, got: dict[str, torch.Tensor],
                         state: dict[str, torch.Tensor], result: Any, took: float,
                         stopped: list[str]) -> None:
    # (a request timeout is 60 s: before, a read of the body waited it out)
    assert took < 20.0, f"the restore waited {took:.1f} s on the replica hung mid-body"
    assert torch.equal(got["w"], state["w"])
    assert result.bytes_from.get("store") == 2 * CHUNK
    members = ckpt.transport.members  # type: ignore[attr-defined]
    assert stopped[0] not in members.live()


def test_a_restore_leaves_a_replica_hung_mid_body_for_the_next_within_seconds(
        static_pair: tuple[Replica, Replica], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CKPTD_SUSPECT_AFTER", "2")  # (the probe's 5 s stay as they are)
    a, b = static_pair
    replicas = {a.url: a, b.url: b}
    # Chunks through the transport's httpx client, as over https:// (plain-HTTP
    # replicas are otherwise read over raw sockets, which this routing does not see).
    monkeypatch.setattr(HttpTransport, "chunk_reads", lambda self, finish: None)
    monkeypatch.setattr(HttpTransport, "chunk_reader", lambda self: None)
    torch.manual_seed(0)
    state = {"w": torch.randn(2 * CHUNK // 4)}
    with Checkpointer(f"{a.url},{b.url}", "hang-body", chunk_size=CHUNK,
                      shm_dir=tmp_path / "shm", serve_peers=False, timeout=60.0) as ckpt:
        assert ckpt.save(1, state).wait(60).state == "committed"
        stopped: list[str] = []

        async def stop_mid_body(resp: httpx.Response) -> None:
            # (a response hook runs once the headers came, before the body is read)
            req = resp.request
            if (not stopped and req.method == "GET" and resp.status_code == 200
                    and req.url.path.startswith("/v1/chunks/")):
                _stop(replicas, f"{req.url.scheme}://{req.url.netloc.decode('ascii')}",
                      stopped)

        client: httpx.AsyncClient = ckpt.transport._client  # type: ignore[attr-defined]
        client.event_hooks["response"].append(stop_mid_body)
        got = {"w": torch.zeros_like(state["w"])}
        t0 = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger="ckptd.client.routing_body"):
            result = ckpt.restore(got, step=1, tiers=("store",))
        took = time.monotonic() - t0
        assert stopped, "no chunk body came from a replica"
        _left_within_seconds(ckpt, got, state, result, took, stopped)
        assert any("given up mid-way" in r.getMessage() for r in caplog.records), \
            "the replica was not stopped mid-body"


def test_a_restore_over_raw_chunk_reads_leaves_a_replica_hung_mid_body_within_seconds(
        static_pair: tuple[Replica, Replica], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same over plain http://, where chunks are read in batches over the
    transport's raw sockets (``PeerClient``): the batch's replica is probed while
    the batch is under way, and its mark ends the batch's reads at once; the
    chunks are read again through the transport, from the next replica."""
    monkeypatch.setenv("CKPTD_SUSPECT_AFTER", "2")
    a, b = static_pair
    replicas = {a.url: a, b.url: b}
    torch.manual_seed(0)
    state = {"w": torch.randn(2 * CHUNK // 4)}
    with Checkpointer(f"{a.url},{b.url}", "hang-raw", chunk_size=CHUNK,
                      shm_dir=tmp_path / "shm", serve_peers=False, timeout=60.0) as ckpt:
        assert ckpt.save(1, state).wait(60).state == "committed"
        stopped: list[str] = []
        answer = PeerClient._answer

        def stop_mid_body(self: PeerClient, conn: Any, url: str, cid: str | None,
                          expect: int) -> Any:
            got = answer(self, conn, url, cid, expect)  # (the headers came)
            if not stopped and url in replicas:
                _stop(replicas, url, stopped)
            return got

        monkeypatch.setattr(PeerClient, "_answer", stop_mid_body)
        got = {"w": torch.zeros_like(state["w"])}
        t0 = time.monotonic()
        result = ckpt.restore(got, step=1, tiers=("store",))
        took = time.monotonic() - t0
        assert stopped, "no batch of chunks went to a replica"
        _left_within_seconds(ckpt, got, state, result, took, stopped)  # (before: 60 s twice)
