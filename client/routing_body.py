"""A response body from a ckptd replica, watched while it streams (``routing.py``).

A replica that hangs after its answer's headers, in the middle of the body (a chunk
download, a large manifest or restore plan), would hold each read of the rest for
httpx's read timeout (the request timeout, 60 s), then the caller's retry. Each
read of the body is watched as ``AsyncRouting._send`` watches a request until its
answer starts: one that waits ``CKPTD_SUSPECT_AFTER`` seconds has the replica's
``/healthz`` asked (again every ``suspect_after`` while it waits); when the replica
is marked down as gone or hung (an unanswered probe, the stall watcher) the read
waiting on it ends at once with ``ReplicaDown``, an ``httpx.ReadError``: the
caller's retry (``Attempts``) takes the request to the next replica, as it does
any body lost mid-way. A body read whole before the mark is the caller's as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx

log = logging.getLogger(__name__)

__all__ = ["ReplicaDown", "WatchedBody", "settle"]


class WatchedBody(httpx.AsyncByteStream):
    """``inner``, the body of ``request``'s answer from ``base``, a read of it given up
    when ``base`` is marked down while it waits; ``probe(base)`` after a read waited
    ``suspect_after`` seconds. Made on the event loop that reads it.

    The reads run in the reader's own task (a task per read cost a fifth more CPU per
    body): a mark cancels that task while it waits in a read, as ``asyncio.timeout``
    does, and the cancellation becomes ``ReplicaDown`` unless the reader was also
    cancelled for its own reasons."""

    def __init__(self, inner: httpx.AsyncByteStream, request: httpx.Request, base: str, *,
                 watch: Callable[[str, Callable[[], None]], Callable[[], None]],
                 probe: Callable[[str], None], suspect_after: float) -> None:
        self.inner = inner
        self.request = request
        self.base = base
        self.probe = probe
        self.suspect_after = suspect_after
        self.down = False  # marked down (as gone or hung) since the body began
        self._loop = loop = asyncio.get_running_loop()
        # The task while it waits in a read of ``inner`` (None between reads: a
        # callback that finds it set runs while that task is suspended in the read).
        self._reader: asyncio.Task[object] | None = None
        self._cut = False  # this side cancelled the reader
        self._timer: asyncio.TimerHandle | None = None

        def tell() -> None:  # (from the thread that marks the replica down)
            with contextlib.suppress(RuntimeError):  # (its loop closed: nothing reads)
                loop.call_soon_threadsafe(self._marked)

        # For the body's whole life, not read by read: after a mark between two
        # reads, the next read that has to wait is given up.
        self._stop = watch(base, tell)

    def _marked(self) -> None:
        self.down = True
        self._cut_read()

    def _cut_read(self) -> None:
        if self._reader is not None and not self._cut:
            self._cut = True
            self._reader.cancel()

    def _suspect(self) -> None:
        if self._reader is None:
            return
        self.probe(self.base)  # (once at a time per replica; again while it waits)
        self._timer = self._loop.call_later(self.suspect_after, self._suspect)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pieces = self.inner.__aiter__()
        while True:
            task = asyncio.current_task()
            assert task is not None
            self._reader, self._cut = task, False
            self._timer = self._loop.call_later(self.suspect_after, self._suspect)
            if self.down:  # (a read that does not wait still gets its bytes)
                self._loop.call_soon(self._cut_read)
            try:
                piece: bytes | None = await pieces.__anext__()
            except StopAsyncIteration:
                piece = None
            except asyncio.CancelledError:
                if self._cut and task.uncancel() == 0:  # (only this side's cancellation)
                    raise self._given_up() from None
                raise
            except BaseException:
                if self._cut:  # (the read turned the cancellation into an error)
                    task.uncancel()
                raise
            finally:
                self._reader = None
                if self._timer is not None:
                    self._timer.cancel()
            if self._cut:  # (the read swallowed the cancellation)
                task.uncancel()
                raise self._given_up()
            if piece is None:
                return
            yield piece

    def _given_up(self) -> ReplicaDown:
        log.debug("a body from %s was given up mid-way: the replica was marked down",
                  self.base)
        return ReplicaDown(f"ckptd replica {self.base} was marked down while it sent "
                           "this answer's body", request=self.request)

    async def aclose(self) -> None:
        self._stop()
        await self.inner.aclose()


class ReplicaDown(httpx.ReadError):
    """A request given up because another call marked its replica down meanwhile
    (maybe sent: retried as any request lost mid-way is)."""


def settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
