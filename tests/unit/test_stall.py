"""The stall watcher tells a vanished host (nothing acknowledged) from a busy live
server (its window shut, every probe answered) by what TCP_INFO says."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from client.stall import GONE_AFTER, TcpState, host_gone, tcp_state

ESTABLISHED = 1


def test_nothing_acknowledged_with_data_in_flight_or_probes_unanswered_is_gone() -> None:
    late = int(GONE_AFTER * 1000) + 1
    assert host_gone(TcpState(ESTABLISHED, 3, 0, late))  # retransmissions unanswered
    assert host_gone(TcpState(ESTABLISHED, 0, 2, late))  # window probes unanswered
    assert not host_gone(TcpState(ESTABLISHED, 3, 0, 200))  # acknowledged a moment ago
    assert not host_gone(TcpState(ESTABLISHED, 1, 1, late))  # one timeout: answered soon
    assert not host_gone(TcpState(ESTABLISHED, 0, 0, 60_000))  # idle: keepalive's business


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO is Linux's")
def test_a_peer_that_stops_reading_is_busy_not_gone() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        client = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
        with client, peer:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.setblocking(False)
            sent = 0
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the window is shut
                try:
                    sent += client.send(b"x" * 65536)
                except BlockingIOError:
                    break
            assert sent > 0
            seen = []
            end = time.monotonic() + 2 * GONE_AFTER + 1
            while time.monotonic() < end:
                state = tcp_state(client)
                assert state is not None
                seen.append(state)
                assert not host_gone(state), seen
                time.sleep(0.1)
            # The window stayed shut and the probes' answers came further apart than
            # GONE_AFTER: what an ACK clock alone would have taken for a lost host.
            assert max(s.since_ack_ms for s in seen) >= GONE_AFTER * 1000 * 0.8, seen
