"""The client's event loops and its one rule for bounded concurrency.

Every coroutine of the client runs on one of two kinds of loop: the long-lived
``EventLoopThread`` a ``Checkpointer`` owns (its transport lives there; saves,
restores and heartbeats go through it), or a private loop that ``run_private``
starts for one synchronous call (the DCP adapter, ``ckptd restore --to DIR``), so
that the call works from any thread, inside a running event loop or not.

The cancellation rule, one for save, restore and DCP alike (``bounded``): an
error never cancels other work. On the first error no new item starts, the ones
running finish, and that error is raised. A running item may be a thread reading
the staging pool (hashing, a store writing a chunk, a copy into the target), and
the pool is overwritten by the next save, and the target read by the caller, as
soon as the call returns: it must not return under a reader. Only a caller's
deadline cancels (``EventLoopThread.run``, ``run_private``), and then the
coroutine unwinds (its ``finally`` blocks run) before the call returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from ckptd.errors import CkptdError, Timeout

T = TypeVar("T")
Item = TypeVar("Item")


class EventLoopThread:
    """A daemon thread running one asyncio loop; coroutines go in from any thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules ``coro`` on the loop; the future completes with its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coro`` on the loop and waits for it; past ``timeout`` it is
        cancelled, unwinds (its worker threads included: ``in_thread``), and then
        ``Timeout`` is raised."""

        return self.submit(_within(coro, timeout, "gave up")).result()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop and joins the thread (after the caller's own cleanup)."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def run_private(coro: Coroutine[Any, Any, T], timeout: float | None = None, *,
                what: str = "call", name: str = "ckptd-call") -> T:
    """Runs ``coro`` to completion on a private event loop in a worker thread and
    returns its result. Past ``timeout`` seconds it is cancelled, unwinds, and
    ``Timeout`` says that ``what`` gave up."""

    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []
    interrupted = threading.Event()

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        running.append((asyncio.get_running_loop(), task))
        if interrupted.is_set():  # (Ctrl-C came before this task began)
            coro.close()
            raise asyncio.CancelledError
        return await _within(coro, timeout, f"{what} gave up")

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        future = pool.submit(asyncio.run, main())
        try:
            return future.result()
        except KeyboardInterrupt:
            # Ctrl-C: the call is cancelled and unwinds (leaving the pool waits for
            # that), where it would otherwise run on to its end, however far. Set
            # before the look at ``running``: a task that is not there yet sees it.
            interrupted.set()
            for loop, task in running:
                with contextlib.suppress(RuntimeError):  # (its loop closed: it ended)
                    loop.call_soon_threadsafe(task.cancel)
            raise


async def _within(coro: Coroutine[Any, Any, T], timeout: float | None, gave_up: str) -> T:
    """``coro``'s result; past ``timeout`` it is cancelled and unwinds, then
    ``Timeout`` ("<gave_up> after N s")."""
    try:
        return await asyncio.wait_for(coro, timeout)
    except CkptdError:  # ckptd's Timeout is a TimeoutError too: keep its message
        raise
    except TimeoutError:
        raise Timeout(f"{gave_up} after {timeout:g} s", after_s=timeout) from None


class ClientClosing(CkptdError):
    """The loop's executor takes no more work: the program is exiting (Ctrl-C, the end
    of the script) or the checkpointer closed while a call was under way."""


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread of the loop's executor. Cancelled, it still
    waits for the thread to finish before it unwinds (``asyncio.to_thread`` lets
    the thread run on after its caller is gone: a copy into the target, or a read
    of the staging pool, after the call that started it returned)."""
    try:
        future = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
    except RuntimeError as exc:  # submit() refuses work only once its executor shut down
        raise ClientClosing("interrupted: the program is exiting (Ctrl-C, or the end of "
                            "the script) or the checkpointer closed") from exc
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


async def bounded(items: Iterable[Item], fn: Callable[[Item], Awaitable[None]], limit: int) -> None:
    """Runs ``fn`` over ``items`` with at most ``limit`` at once.

    On the first error no new item starts, the ones running finish, and that error
    is raised; nothing is cancelled (the module's rule)."""
    it = iter(items)
    failed: list[BaseException] = []

    async def worker() -> None:
        for item in it:  # one shared iterator: each item goes to one worker
            if failed:
                return
            try:
                await fn(item)
            except BaseException as exc:
                failed.append(exc)
                return

    await asyncio.gather(*(worker() for _ in range(max(1, limit))))
    if failed:
        raise failed[0]


async def spread(items: Sequence[Item], fn: Callable[[Item], T], workers: int) -> list[T]:
    """``fn`` over ``items`` on up to ``workers`` worker threads that each take the
    next item themselves; the results in the order of ``items``.

    One trip through the loop per thread, not per item: hundreds of chunk hashes
    or copies of a millisecond each otherwise wait on the loop thread between
    items, and it competes with them for the cores. The module's rule holds: on
    the first error no new item starts, the running ones finish, and that error
    is raised; cancelled, no new item starts and it waits for the running ones."""
    results: dict[int, T] = {}
    order = iter(range(len(items)))
    take = threading.Lock()
    failed: list[BaseException] = []
    stop = threading.Event()

    def work() -> None:
        while not failed and not stop.is_set():
            with take:
                k = next(order, None)
            if k is None:
                return
            try:
                results[k] = fn(items[k])
            except BaseException as exc:
                failed.append(exc)
                return

    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(None, work)
               for _ in range(max(1, min(workers, len(items))))]
    try:
        await asyncio.shield(asyncio.gather(*futures))
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait(futures)
        raise
    if failed:
        raise failed[0]
    return [results[k] for k in range(len(items))]
