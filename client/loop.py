"""The client's event loop and its one rule for bounded concurrency."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ckptd.errors import Timeout

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
        """Runs ``coro`` on the loop and waits for it; ``Timeout`` after ``timeout``."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Timeout(f"gave up after {timeout} s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop and joins the thread (after the caller's own cleanup)."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def bounded(items: Iterable[Item], fn: Callable[[Item], Awaitable[None]], limit: int) -> None:
    """Runs ``fn`` over ``items`` with at most ``limit`` at once.

    On the first error no new item starts, the ones running finish, and that error
    is raised. Nothing is cancelled: a running item may be a thread reading the
    staging pool (hashing, a store writing a chunk), and the pool is overwritten by
    the next save as soon as this returns, so it must not return under a reader."""
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
