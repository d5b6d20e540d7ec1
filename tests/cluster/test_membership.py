"""Membership of replicas over one store: a static --peers list, or leases in the
store that replicas renew, give back at shutdown, and let expire when killed."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from ckptd.api import ClusterView
from ckptd.client.transport import HttpTransport
from tests.cluster.conftest import Cluster, Replica


def urls(replica: Replica) -> list[str]:
    doc = replica.cluster()
    return sorted(str(m["url"]) for m in doc["members"])  # type: ignore[union-attr]


async def _cluster_of(url: str) -> ClusterView:
    transport = HttpTransport(url)
    try:
        return await transport.cluster()
    finally:
        await transport.close()


def wait_until(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_a_lone_server_lists_itself(tmp_path: Path) -> None:
    replica = Replica(str(tmp_path / "store"), tmp_path).start()
    try:
        doc = replica.cluster()
        assert doc["mode"] == "single"
        assert urls(replica) == [replica.url]
    finally:
        replica.stop()


def test_static_peers_are_listed_by_every_replica(tmp_path: Path) -> None:
    a = Replica(str(tmp_path / "store"), tmp_path)
    b = Replica(str(tmp_path / "store"), tmp_path)
    peers = f"{a.url},{b.url}/"
    for r in (a, b):
        r.args = ["--peers", peers]
    try:
        a.start(), b.start()
        for r in (a, b):
            assert r.cluster()["mode"] == "static"
            assert urls(r) == sorted([a.url, b.url])
        view = asyncio.run(_cluster_of(b.url))  # the transport's typed call
        assert view.mode == "static" and [m.url for m in view.members] == [a.url, b.url]
    finally:
        a.stop(), b.stop()


@pytest.mark.slow
def test_leases_join_leave_and_expire(lease_cluster: Cluster) -> None:
    a, b = lease_cluster.add(), lease_cluster.add()
    assert urls(a) == urls(b) == sorted([a.url, b.url])
    assert a.cluster()["mode"] == "lease"
    # A replica that shuts down gives its lease back: gone at once.
    b.stop()
    assert urls(a) == [a.url]
    # One killed keeps its lease until it runs out (1.5 s), renewed until then.
    c = lease_cluster.add()
    assert urls(a) == sorted([a.url, c.url])
    time.sleep(2.0)
    assert urls(a) == sorted([a.url, c.url]), "a live lease must be renewed"
    c.stop(signal.SIGKILL)
    assert wait_until(lambda: urls(a) == [a.url], 4.0), urls(a)
