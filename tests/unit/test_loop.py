"""The client's one cancellation rule (``ckptd.client.loop``): an error never
cancels other work; only a caller's deadline does, and the work unwinds first."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ckptd.client.loop import bounded, run_private
from ckptd.errors import CkptdError, Timeout


class Boom(CkptdError):
    pass


async def test_bounded_runs_at_most_limit_at_once_and_every_item() -> None:
    running = peak = 0
    seen: list[int] = []

    async def one(i: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001)
        seen.append(i)
        running -= 1

    await bounded(range(20), one, 3)
    assert peak == 3 and sorted(seen) == list(range(20))


async def test_an_error_lets_running_items_finish_and_starts_no_new_one() -> None:
    started: list[int] = []
    finished: list[int] = []
    release = asyncio.Event()

    async def one(i: int) -> None:
        started.append(i)
        if i == 1:
            await asyncio.sleep(0.005)  # 0 and 2 are running by then
            raise Boom("item 1 failed")
        await release.wait()  # a reader of the pool, still running when 1 fails
        finished.append(i)

    async def later() -> None:
        await asyncio.sleep(0.05)
        release.set()

    releaser = asyncio.create_task(later())
    with pytest.raises(Boom):
        await bounded(range(10), one, 3)
    await releaser
    # 0 and 2 were running when 1 failed: they finished (not cancelled) before
    # bounded returned; nothing past them started.
    assert sorted(started) == [0, 1, 2]
    assert sorted(finished) == [0, 2]


def test_run_private_works_inside_a_running_loop() -> None:
    async def inner() -> str:
        return threading.current_thread().name

    async def outer() -> str:
        return run_private(inner(), 5, name="ckptd-test")

    assert asyncio.run(outer()).startswith("ckptd-test")


def test_a_deadline_cancels_and_the_work_unwinds_before_timeout_is_raised() -> None:
    unwound = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            unwound.set()

    with pytest.raises(Timeout, match="the test call"):
        run_private(slow(), 0.05, what="the test call")
    assert unwound.is_set()


def test_run_private_keeps_a_ckptd_error() -> None:
    async def fails() -> None:
        raise Boom("typed")

    with pytest.raises(Boom):
        run_private(fails(), 5)


def test_a_deadline_on_the_loop_thread_waits_for_the_worker_threads() -> None:
    """``EventLoopThread.run``: past the deadline the coroutine is cancelled, and
    a copy it started on a worker thread (``in_thread``) has finished before
    ``Timeout`` reaches the caller, who may then read or reuse that memory."""
    import time

    from ckptd.client.loop import EventLoopThread, in_thread

    finished = threading.Event()

    def copy() -> None:
        time.sleep(0.3)
        finished.set()

    async def restore() -> None:
        await bounded(range(2), lambda _: in_thread(copy), 2)

    loop = EventLoopThread("test-loop")
    try:
        with pytest.raises(Timeout):
            loop.run(restore(), 0.05)
        assert finished.is_set()
        assert loop.run(asyncio.sleep(0, "still serves"), 5) == "still serves"
    finally:
        loop.stop()


def test_ctrl_c_of_a_call_that_just_ended_is_a_keyboard_interrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a probe: Ctrl-C landing as the call's loop closed raised
    RuntimeError('Event loop is closed') from the cancel, a traceback and exit 1
    where ckptd restore says 'interrupted' and exits 130."""
    import concurrent.futures

    result = concurrent.futures.Future.result

    def interrupted(self: concurrent.futures.Future[object], timeout: float | None = None
                    ) -> object:
        result(self, timeout)  # the call ends and its loop closes; then the signal
        raise KeyboardInterrupt

    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_private(asyncio.sleep(0))


def test_ctrl_c_before_the_call_began_still_cancels_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C before the call's task had started found nothing to cancel, and leaving
    the pool waited for the whole call."""
    import concurrent.futures
    import time

    def interrupted(self: concurrent.futures.Future[object], timeout: float | None = None
                    ) -> object:
        raise KeyboardInterrupt  # at once: the worker thread may not have started it

    run = asyncio.run

    def late(main: Any) -> Any:  # the worker thread starts the call after the signal
        time.sleep(0.2)
        return run(main)

    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
    monkeypatch.setattr(asyncio, "run", late)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_private(asyncio.sleep(60))
    assert time.monotonic() - began < 5
