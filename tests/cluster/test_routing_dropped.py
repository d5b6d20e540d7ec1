"""A membership read whose connection the replica drops without an answer (a live
server closing a kept-alive connection as idle just as the read arrives) is asked
again on a fresh connection: it marks no replica down. Before, it did, and a
newcomer replica was sent chunks that were another's (a failover that never was)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ckptd.client.routing import Members
from ckptd.client.transport import HttpTransport
from ckptd.client.transport_http import SyncTransport
from tests.conftest import ServerProcess
from tests.relay import relay


class DropOne:
    """Drops the second membership read the relay sees (the first identifies)."""

    def __init__(self) -> None:
        self.reads = 0
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str) -> bool:
        if path != "/v1/cluster":
            return False
        with self.lock:
            self.reads += 1
            return self.reads == 2


@pytest.fixture
def refresh(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("CKPTD_CLUSTER_REFRESH", "0.05")
    return 0.05


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_dropped_membership_read_marks_no_replica_down(
        server: ServerProcess, refresh: float, face: str) -> None:
    drops = DropOne()
    with relay(server.url, drop=drops) as front:
        urls = f"{front},{server.url}"
        members = (_sync_calls if face == "sync" else _async_calls)(urls, drops, refresh)
        assert drops.reads >= 3, "the relay saw too few membership reads"
        assert members.failovers == 0, "a dropped read marked a live replica down"
        assert front in members.live()


def _sync_calls(urls: str, drops: DropOne, refresh: float) -> Members:
    transport = SyncTransport(urls, timeout=30.0)
    try:
        for _ in range(200):  # bounded: ~10 s of refreshes
            assert transport.healthz() is not None
            if drops.reads >= 3:
                break
            time.sleep(refresh)
    finally:
        transport.close()
    return transport.members


def _async_calls(urls: str, drops: DropOne, refresh: float) -> Members:
    async def calls() -> Members:
        transport = HttpTransport(urls, timeout=30.0)
        try:
            for _ in range(200):
                await transport.list_jobs()
                if drops.reads >= 3:
                    break
                await asyncio.sleep(refresh)
        finally:
            await transport.close()
        return transport.members

    return asyncio.run(calls())
