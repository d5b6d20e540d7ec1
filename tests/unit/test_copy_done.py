"""``CopyDone.synchronize`` with a timeout (``handle.staged(timeout=...)``): the host
learns that the staging copies ended when they end, not at its next poll. The events
here stand in for CUDA events (absent hardware) with the same two calls."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Any

import pytest
import torch

from ckptd.client.cuda import CopyDone
from ckptd.client.save.handle import SaveHandle
from ckptd.errors import InvalidRequest, Timeout

pytestmark = pytest.mark.timeout(30)


class Copies:
    """A device's copies that end ``seconds`` after they were queued."""

    def __init__(self, seconds: float | None) -> None:
        self.finished = threading.Event()
        self.queries = 0
        self.ended_at = 0.0
        if seconds is not None:
            timer = threading.Timer(seconds, self.end)
            timer.daemon = True
            timer.start()

    def end(self) -> None:
        self.ended_at = time.perf_counter()
        self.finished.set()

    def query(self) -> bool:
        self.queries += 1
        return self.finished.is_set()

    def synchronize(self) -> None:  # a blocking-sync event: sleeps until the copies end
        self.finished.wait()


def test_staged_with_a_timeout_wakes_when_the_copies_end_not_at_a_poll() -> None:
    copies = [Copies(0.043), Copies(0.02)]
    done = CopyDone([(torch.device("cpu"), c) for c in copies])
    done.synchronize(timeout=10)
    woke = time.perf_counter()
    assert all(c.finished.is_set() for c in copies)
    # Slept on the events: asked once whether they were done, not every few
    # milliseconds (polling with a growing sleep woke up to 10 ms after the end).
    assert sum(c.queries for c in copies) <= len(copies)
    assert woke - copies[0].ended_at < 0.5  # (loose: a loaded CI host schedules late)


def test_staged_with_a_timeout_times_out_while_the_copies_run() -> None:
    never = Copies(None)
    done = CopyDone([(torch.device("cpu"), never)])
    t0 = time.perf_counter()
    with pytest.raises(Timeout, match="still running after 0.2 s"):
        done.synchronize(timeout=0.2)
    assert 0.2 <= time.perf_counter() - t0 < 5
    never.end()  # (the waiting thread ends with them)


def test_staged_with_a_timeout_returns_at_once_when_the_copies_are_done() -> None:
    over = Copies(None)
    over.end()
    done = CopyDone([(torch.device("cpu"), over)])
    done.synchronize(timeout=1)
    assert over.queries == 1


def test_staged_asked_again_and_again_while_the_copies_run_starts_one_thread() -> None:
    slow = Copies(None)
    done = CopyDone([(torch.device("cpu"), slow)])
    before = threading.active_count()
    for _ in range(50):  # a loop that polls staged(timeout=0) while it does other work
        with pytest.raises(Timeout):
            done.synchronize(timeout=0)
    assert threading.active_count() <= before + 1
    slow.end()
    done.synchronize(timeout=10)


class Failing(Copies):
    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access (a test's)")


def test_an_error_the_events_meet_reaches_the_caller_not_the_thread_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hooked: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args.exc_value))
    done = CopyDone([(torch.device("cpu"), Failing(None))])
    for _ in range(2):  # told to every caller
        with pytest.raises(RuntimeError, match="illegal memory access"):
            done.synchronize(timeout=10)
    assert hooked == []


def test_staged_without_a_limit_given_as_infinity_waits_for_the_copies() -> None:
    # math.inf is more than a lock can wait (OverflowError): it means no limit.
    copies = Copies(0.05)
    CopyDone([(torch.device("cpu"), copies)]).synchronize(timeout=math.inf)
    assert copies.finished.is_set()


def test_staged_when_no_waiting_thread_can_start_waits_on_the_caller_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A process at its thread limit: the copies' end must still be noticed, by this
    # call and the next, not sat out to the timeout.
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "ckptd-staged":
            raise RuntimeError("can't start new thread")
        start(thread)

    copies = Copies(0.05)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    done = CopyDone([(torch.device("cpu"), copies)])
    t0 = time.perf_counter()
    done.synchronize(timeout=20)
    done.synchronize(timeout=20)
    assert copies.finished.is_set() and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("bad", [-1, float("nan"), "5", True])
def test_a_save_handle_s_timeout_that_is_no_number_of_seconds_is_refused(bad: object) -> None:
    handle = SaveHandle(1, concurrent.futures.Future(), copy_done=CopyDone([]))
    with pytest.raises(InvalidRequest, match="takes seconds"):
        handle.staged(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="takes seconds"):
        handle.wait(timeout=bad)  # type: ignore[arg-type]


def test_a_save_handle_waits_without_limit_on_infinity() -> None:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    threading.Timer(0.05, future.set_result, ("result",)).start()
    handle = SaveHandle(1, future, copy_done=CopyDone([]))
    handle.staged(timeout=math.inf)
    assert handle.wait(timeout=math.inf) == "result"
