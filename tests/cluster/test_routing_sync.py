"""The sync face of routing (heartbeats, the health agent, the CLI) asks every
replica for the membership at once on its first read: replicas that hang cost the
read's timeout once, not once each before the live one is asked."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ckptd.client.transport_http import SyncTransport
from tests.conftest import ServerProcess
from tests.listeners import silent_listener

_LEARN_READ_TIMEOUT = 5.0  # (client/routing.py's _LEARN_TIMEOUT)


@pytest.fixture
def hung_urls() -> Iterator[list[str]]:
    """Two listeners that never answer: the kernel takes the connection (the
    backlog), the bytes sent, and nothing comes back, as from a stopped process."""
    with silent_listener() as a, silent_listener() as b:
        yield [a, b]


def test_the_first_membership_read_asks_hung_replicas_at_once(
        server: ServerProcess, hung_urls: list[str]) -> None:
    transport = SyncTransport(",".join([*hung_urls, server.url]), timeout=30.0)
    try:
        t0 = time.monotonic()
        assert transport.healthz() is not None
        took = time.monotonic() - t0
        # One by one, the two hung replicas held the first call 2 x 5 s.
        assert took < 2 * _LEARN_READ_TIMEOUT - 1.0, f"the first call took {took:.1f}s"
        assert transport.members.live() == [server.url]
        assert transport.jobs() is not None  # (routed to the live one, no wait)
    finally:
        transport.close()
