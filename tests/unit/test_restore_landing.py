"""A restore's fresh memory (``client/restore/memory.py``): landing memory in one
map, and a worker thread (``Prefault``) that faults fresh memory in ahead of the
chunks that land in it and of delivery."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from ckptd.client.restore import fetch, memory
from ckptd.client.restore.memory import Landing, Prefault, span_of
from ckptd.knobs import MiB
from tests.residency import resident_share

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux advice")


def _populate_works() -> bool:
    if memory._MADVISE is None:
        return False
    probe = memory.fresh_bytes(8 * MiB)
    base, n = span_of(probe)
    return memory._MADVISE(ctypes.c_void_p(base), ctypes.c_size_t(n), Prefault.ADVICE) == 0


needs_populate = pytest.mark.skipif(not sys.platform.startswith("linux") or not _populate_works(),
                                    reason="this kernel has no MADV_POPULATE_WRITE")


def test_an_expected_landing_is_one_map_handed_out_in_order() -> None:
    landing = Landing(expect=64 * MiB)
    ahead = landing.ahead()
    assert ahead is not None and len(ahead) == 64 * MiB
    views = [landing.take(4 * MiB) for _ in range(16)]
    assert all(v.obj is views[0].obj for v in views)  # the same map, no new block
    assert span_of(views[1])[0] == span_of(views[0])[0] + 4 * MiB
    assert landing.take(MiB).obj is not views[0].obj  # past it: a block of its own


def test_without_an_expectation_landing_comes_in_blocks() -> None:
    landing = Landing(block=8 * MiB)
    assert landing.ahead() is None
    views = [landing.take(3 * MiB) for _ in range(3)]
    assert views[0].obj is views[1].obj and views[2].obj is not views[0].obj


@needs_populate
def test_fresh_memory_is_faulted_in_ahead_of_the_chunks_and_of_delivery() -> None:
    landing = Landing(expect=32 * MiB)
    ahead = landing.ahead()
    assert ahead is not None
    later = memory.fresh_bytes(16 * MiB)
    first = [(span_of(ahead)[0] + k * 4 * MiB, 4 * MiB) for k in range(8)]
    pre = Prefault.start(first, [span_of(later)], lambda: 0, [ahead, later])
    assert pre is not None, "no worker faulted the fresh memory in"
    pre._thread.join(timeout=60)
    assert not pre.running()
    # Untouched by any chunk or copy, yet in memory: the worker faulted it in.
    assert resident_share(ahead) > 0.99
    assert resident_share(later) > 0.99


@needs_populate
def test_the_worker_skips_what_the_chunks_have_reached() -> None:
    landing = Landing(expect=64 * MiB)
    ahead = landing.ahead()
    assert ahead is not None
    first = [(span_of(ahead)[0] + k * 4 * MiB, 4 * MiB) for k in range(16)]
    pre = Prefault.start(first, [], lambda: 8, [ahead])  # half the chunks started
    assert pre is not None
    pre._thread.join(timeout=60)
    assert resident_share(ahead[32 * MiB :]) > 0.99
    assert resident_share(ahead[: 32 * MiB]) < 0.01  # left to the chunks landing there


@linux_only
def test_stopping_the_worker_leaves_what_landed() -> None:
    landing = Landing(expect=256 * MiB)
    ahead = landing.ahead()
    assert ahead is not None
    pre = Prefault.start([span_of(ahead)], [], lambda: 0, [ahead])
    view = landing.take(MiB)
    view[:5] = b"chunk"
    if pre is not None:
        pre.stop()
        assert not pre.running()
    assert bytes(view[:5]) == b"chunk"


def test_a_restore_plan_of_fresh_memory_follows_where_chunks_land() -> None:
    """``_fresh_spans``: an atomic restore lands a network chunk in its fresh
    buffer, else in landing memory; a chunk held in place lands nowhere, and its
    fresh buffers are delivery's."""
    target = torch.zeros(4 * MiB, dtype=torch.uint8)  # the target's own tensor
    fresh_a = memory.fresh_tensor((4 * MiB,), torch.uint8)
    fresh_b = memory.fresh_tensor((4 * MiB,), torch.uint8)
    wanted = fetch.WantedChunks()
    mv = lambda t: memoryview(t.numpy()).cast("B")  # noqa: E731
    wanted.add("a" * 64, mv(fresh_a), "a")
    wanted.add("b" * 64, mv(target), "b", in_target=True)
    wanted.add("c" * 64, mv(fresh_b), "c")
    landing = Landing(expect=4 * MiB)
    ahead = landing.ahead()
    assert ahead is not None
    first, then = fetch._fresh_spans(wanted, True, {"c" * 64}, landing)
    assert first == [span_of(mv(fresh_a)), span_of(ahead[: 4 * MiB]), (0, 0)]
    assert then == [span_of(mv(fresh_b))]
    # Not atomic: each chunk lands in its first destination, the target's included.
    first, then = fetch._fresh_spans(wanted, False, {"c" * 64}, Landing())
    assert first == [span_of(mv(fresh_a)), (0, 0), span_of(mv(fresh_b))]
    assert then == []


def test_the_worker_ends_by_itself() -> None:
    before = {t.ident for t in threading.enumerate() if t.name == "ckptd-prefault"}
    landing = Landing(expect=8 * MiB)
    ahead = landing.ahead()
    assert ahead is not None
    pre = Prefault.start([span_of(ahead)], [], lambda: 0, [ahead])
    if pre is not None:
        deadline = time.monotonic() + 60
        while pre.running() and time.monotonic() < deadline:
            time.sleep(0.01)  # it ends by itself once it advised everything
        assert not pre.running()
    left = {t.ident for t in threading.enumerate() if t.name == "ckptd-prefault"} - before
    assert not left


def _third_read_in_start_raises(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """The third read-in thread's start raises ``error``; the others start."""
    real_start = threading.Thread.start
    starts = [0]

    def start(self: threading.Thread) -> None:
        if self.name == "ckptd-read-in":
            starts[0] += 1
            if starts[0] == 3:
                raise error
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_a_read_in_whose_threads_cannot_all_start_gives_up_and_leaves_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ReadIn`` starts every thread before any reads in; one that cannot start
    (no threads to be had) ends the read-in: the started ones are stopped and
    joined, and the restore goes on without it (pages fault in as read)."""
    pool = torch.empty(32 * MiB, dtype=torch.uint8)
    _third_read_in_start_raises(monkeypatch, RuntimeError("can't start new thread"))
    view = memoryview(pool.numpy())
    assert memory.ReadIn.start([span_of(view)], 4, [pool]) is None
    assert not any(t.name == "ckptd-read-in" for t in threading.enumerate())


def test_a_read_in_interrupted_while_its_threads_start_leaves_none_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt (Ctrl-C) while ``ReadIn`` starts its threads goes on to the
    caller, and the threads already started end: none waits for ever to begin."""
    pool = torch.empty(32 * MiB, dtype=torch.uint8)
    _third_read_in_start_raises(monkeypatch, KeyboardInterrupt())
    view = memoryview(pool.numpy())
    with pytest.raises(KeyboardInterrupt):
        memory.ReadIn.start([span_of(view)], 4, [pool])
    deadline = time.monotonic() + 10
    while any(t.name == "ckptd-read-in" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a read-in thread still waits to begin"
        time.sleep(0.01)
