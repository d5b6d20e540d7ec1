"""``close()`` asks the server about every step still pending on this rank, so
that a step that can never commit (replicas that disagree, found by a peer's
commit) is this rank's failure too, and says so, even when the loop never asked.
The questions go out at once: on a loaded host each answer came slowly, and asked
one after another, within close's bound of 10 s, the older step went unasked (the
README loop's test failed so once: its rank closed with ``failed 0``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import ReplicaMismatch
from tests.conftest import ServerProcess
from tests.relay import relay

pytestmark = pytest.mark.timeout(120)

SLOW_S = 6.0  # each commit question's answer at close; two of them exceed 10 s in a row


def test_close_asks_every_pending_step_at_once(shared_server: ServerProcess,
                                               shm: Path) -> None:
    job = "close-pending"
    slow = threading.Event()

    def late(method: str, path: str) -> float:
        return SLOW_S if slow.is_set() and method == "POST" and path.endswith("/commit") else 0

    (shm / "0").mkdir()
    (shm / "1").mkdir()
    with relay(shared_server.url, delay=late) as url:
        one = Checkpointer(url, job, rank=1, world_size=2, shm_dir=shm / "1",
                           serve_peers=False, heartbeat_interval=60)
        try:
            # Steps 0 and 100 of rank 1, pending: rank 0 saved neither yet (step 100
            # it never will). Then rank 0's step 0 disagrees with rank 1's.
            assert one.save(0, {"w": torch.ones(64)}).wait(30).state == "pending"
            assert one.save(100, {"w": torch.ones(64)}).wait(30).state == "pending"
            with Checkpointer(shared_server.url, job, rank=0, world_size=2,
                              shm_dir=shm / "0", serve_peers=False,
                              heartbeat_interval=60) as zero, pytest.raises(ReplicaMismatch):
                zero.save(0, {"w": torch.zeros(64)}).wait(30)
            slow.set()
            t0 = time.monotonic()
            with pytest.raises(ReplicaMismatch) as failed:
                one.close()
            took = time.monotonic() - t0
        finally:
            one.close()
    assert "step 0" in str(failed.value), failed.value
    assert took < SLOW_S + 4.0, took  # the two questions side by side, not in a row


def test_close_reports_the_steps_still_undecided(shared_server: ServerProcess,
                                                 shm: Path) -> None:
    """A rank that closed before the other ranks' manifests of its last step were in
    reported ``failed=0`` and nothing else, for a step that might never commit: its
    ``pending`` names it, and a step that committed meanwhile leaves it."""
    job = "close-undecided"
    ranks = []
    for rank in (0, 1):
        (shm / str(rank)).mkdir()
        ranks.append(Checkpointer(shared_server.url, job, rank=rank, world_size=2,
                                  shm_dir=shm / str(rank), serve_peers=False,
                                  heartbeat_interval=60))
    zero, one = ranks
    try:
        for ckpt in ranks:
            ckpt.save(1, {"w": torch.ones(64)}).wait(30)
        assert one.save(2, {"w": torch.ones(64)}).wait(30).state == "pending"
        assert one.save(3, {"w": torch.ones(64)}).wait(30).state == "pending"
        assert zero.save(2, {"w": torch.ones(64)}).wait(30).state == "committed"
        closed = one.close(timeout=20)
        assert (closed.failed, closed.pending) == (0, (3,)), closed
        assert one.close().pending == (3,)  # (idempotent)
        assert zero.close().pending == ()
    finally:
        for ckpt in ranks:
            ckpt.close()
