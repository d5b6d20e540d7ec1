"""A rank's peer server is reachable from other hosts by default, still behind the
job's peer token, and advertises an address other hosts reach: its address on
the route to the ckptd server (the source of its heartbeats, which the server
registers), or the interface the user names (``client/peer/address.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.peer import peer_address, route_address
from ckptd.client.peer.address import WILDCARDS, interface_address
from ckptd.errors import InvalidRequest
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)


def _ranks(server: ServerProcess, job: str) -> list[dict[str, object]]:
    return list(httpx.get(f"{server.url}/v1/jobs/{job}/ranks", timeout=10).json()["ranks"])


def test_a_checkpointers_peer_server_listens_for_other_hosts(server: ServerProcess,
                                                             shm: Path) -> None:
    with Checkpointer(server.url, "far", shm_dir=shm) as ckpt:
        peer = ckpt.peer_server
        assert peer is not None
        assert peer.host in WILDCARDS  # every interface, not 127.0.0.1 only
        # Advertised: the address its heartbeats come from (the server registers it).
        assert peer.url == f"http://127.0.0.1:{peer.port}"
        assert ckpt.save(1, {"w": torch.arange(1000.0)}).wait(30).state == "committed"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not [
                r for r in _ranks(server, "far") if r["peer_url"] == peer.url]:
            time.sleep(0.1)
        assert [r["peer_url"] for r in _ranks(server, "far")] == [peer.url]
        reply = ckpt.last_heartbeat_reply
        assert reply is not None and reply.peer_url_refused is None
        # This host's address on its default route reaches it too, and only with the
        # job's peer token does it serve anything.
        here = route_address()
        if here != "127.0.0.1":
            base = f"http://{here}:{peer.port}"
            assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
            assert httpx.get(f"{base}/v1/peer", timeout=5).status_code == 401
            token = {"Authorization": f"Bearer {peer.token}"}
            assert httpx.get(f"{base}/v1/peer", headers=token, timeout=5).json()["step"] == 1


def test_a_named_interface_is_where_peers_reach_it(server: ServerProcess, shm: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_address("lo") == "127.0.0.1"
    monkeypatch.setenv("CKPTD_PEER_INTERFACE", "lo")
    with Checkpointer(server.url, "lo", shm_dir=shm) as ckpt:
        peer = ckpt.peer_server
        assert peer is not None and peer.host == "127.0.0.1"  # listens there only
        assert peer.url == f"http://127.0.0.1:{peer.port}"
    monkeypatch.setenv("CKPTD_PEER_INTERFACE", "no-such-if0")
    with pytest.raises(InvalidRequest, match=r"'no-such-if0' \(CKPTD_PEER_INTERFACE\).*lo"):
        Checkpointer(server.url, "lo", shm_dir=shm)


def test_what_a_peer_server_binds_and_advertises(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CKPTD_PEER_HOST", "CKPTD_PEER_INTERFACE", "CKPTD_PEER_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)
    # Every interface, advertised at the route to the server: of replicas, the first.
    assert peer_address(toward="http://127.0.0.1:8470,http://10.9.9.9:8470") == (
        peer_address(toward="http://127.0.0.1:8470"))
    assert peer_address(toward="http://127.0.0.1:8470").bind == "0.0.0.0"
    assert peer_address(toward="http://127.0.0.1:8470").advertise == "127.0.0.1"
    assert peer_address(toward="http://[::1]:8470").bind == "::"  # the address's family
    # One address bound: advertised as it is; or named outright.
    assert peer_address("127.0.0.1", toward="http://10.9.9.9:8470").advertise == "127.0.0.1"
    monkeypatch.setenv("CKPTD_PEER_ADVERTISE_HOST", "198.18.0.7")
    assert peer_address(toward="http://127.0.0.1:8470").advertise == "198.18.0.7"
