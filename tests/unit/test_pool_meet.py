"""The ranks of a launch meet around a restore (client/restore/meet.py): a rank with
no pool waits until every other rank served its pool or said it has none, at most
CKPTD_POOL_WAIT seconds, through a real c10d store."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed import HashStore

from ckptd.client.restore.meet import PoolMeet


def _meets(world: int) -> list[PoolMeet]:
    store = HashStore()
    return [PoolMeet(store, "ckptd/pools/launch-1/job/", r, world) for r in range(world)]


def test_a_rank_without_a_pool_waits_until_every_other_rank_said_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CKPTD_POOL_WAIT", "10")
    new, *survivors = _meets(3)
    done: list[tuple[bool, float]] = []
    t0 = time.monotonic()
    waiter = threading.Thread(target=lambda: done.append(
        (new.wait_for_others(), time.monotonic() - t0)))
    waiter.start()
    time.sleep(0.3)
    survivors[0].say()
    assert not done  # one survivor is not enough
    time.sleep(0.2)
    survivors[1].say()
    waiter.join(5)
    assert done and done[0][0] and 0.4 < done[0][1] < 5


def test_a_rank_that_never_says_holds_nobody_longer_than_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CKPTD_POOL_WAIT", "0.3")
    new, survivor, _silent = _meets(3)
    survivor.say()
    t0 = time.monotonic()
    assert new.wait_for_others() is False
    assert time.monotonic() - t0 < 3


def test_saying_is_once_and_a_gone_store_does_not_raise() -> None:
    class Gone:
        calls = 0

        def set(self, key: str, value: str) -> None:
            Gone.calls += 1
            raise RuntimeError("connection reset by peer")

    meet = PoolMeet(Gone(), "p/", 0, 2)
    meet.say()
    meet.say()
    assert Gone.calls == 1 and meet.said


def test_nothing_to_meet_without_a_group_or_with_one_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert PoolMeet.here("job", 0, 1) is None
    assert PoolMeet.here("job", 0, 4) is None  # no process group in this process
    monkeypatch.setenv("CKPTD_POOL_WAIT", "0")
    assert PoolMeet.here("job", 0, 4) is None
