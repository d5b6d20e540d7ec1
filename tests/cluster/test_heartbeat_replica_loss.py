"""A heartbeat whose replica dies while it is under way reaches the next replica at
once, not an interval later: the job's liveness must not wait on a replica's death."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from ckptd.client.health.heartbeat import Heartbeat
from ckptd.cluster import home, job_key
from tests.cluster.conftest import Replica


def _job_at_home(url: str, urls: list[str]) -> str:
    """A job name whose home replica is ``url``."""
    return next(j for j in (f"beat-{i}" for i in range(1000)) if home(job_key(j), urls) == url)


def _unread(port: int) -> bool:
    """Whether a connection accepted on ``port`` holds bytes its server has not read."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if int(local.rsplit(":", 1)[1], 16) == port and state == "01" and \
                int(queues.split(":")[1], 16) > 0:
            return True
    return False


def test_a_beat_lost_with_its_replica_is_sent_again_to_the_next(
        static_pair: tuple[Replica, Replica]) -> None:
    a, b = static_pair
    hb: Heartbeat | None = None
    try:
        job = _job_at_home(a.url, [a.url, b.url])
        # A long interval: only the beats this test sends go.
        hb = Heartbeat(f"{a.url},{b.url}", job, 0, 1, interval=600.0, timeout=20.0)
        assert hb.beat_now() is not None  # to its home, a; the connection stays open
        assert a.proc is not None
        # a stops with the next beat in its socket, then dies: the beat is lost mid-way.
        a.proc.send_signal(signal.SIGSTOP)
        replies: list[object] = []
        sender = threading.Thread(target=lambda: replies.append(hb.beat_now()))
        t0 = time.monotonic()
        sender.start()
        # Killed only once the beat lies unread in its socket: lost mid-way, not
        # refused (a refused beat goes to b on any code).
        deadline = time.monotonic() + 20.0
        while not _unread(a.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _unread(a.port), "the beat never reached the stopped replica's socket"
        a.stop(signal.SIGKILL)
        sender.join(30.0)
        took = time.monotonic() - t0
        assert not sender.is_alive()
        assert replies and replies[0] is not None, "the beat was lost with its replica"
        assert hb.failures == 0 and hb.beats == 2
        assert took < 10.0, f"the beat reached the next replica only after {took:.1f}s"
        status = b.cluster()
        assert status["mode"] == "static"
    finally:
        if hb is not None:
            hb.stop()
