"""Chunk reads from a ckptd server, several per request: the store tier's reads that
wait at the same time are sent together to their home replica (``POST
/v1/chunks/read``), so the server's cost per request is paid once per batch.

Nothing waits to fill a batch: a read goes out at the next turn of the event loop
when a lane (a connection to its replica) is free, with the reads that came in the
same turn; while every lane is busy, the reads that come in wait and go out
together when one frees. Each chunk is handed back, verified by ``finish`` in the
reading thread, as soon as it is in its buffer, not when its batch ends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptd.chunk_reads import MAX_CHUNK_READ
from ckptd.errors import CkptdError, Unavailable

# (replica URL, [(chunk id, its buffer)], each(i, error or None)): PeerClient.fetch_many_into
ReadMany = Callable[[str, Sequence[tuple[str, memoryview]],
                     Callable[[int, CkptdError | None], None]], None]

# (replica URL) -> what watches it while a request to it is under way (routing's
# probe of a replica that hangs, ``AsyncRouting.watching``)
Watch = Callable[[str], contextlib.AbstractAsyncContextManager[None]]

# Requests in flight to one replica at once: two, so that the server sends one
# batch while this side verifies the other's chunks.
LANES = 2
# Chunks one request asks for at most (the server takes up to MAX_CHUNK_READ).
MOST = min(16, MAX_CHUNK_READ)


@dataclass(slots=True, eq=False)  # (found by identity)
class _Read:
    cid: str
    dest: memoryview
    future: asyncio.Future[str]
    settled: bool = field(default=False)


class BatchedChunkReads:
    """Reads chunks into their buffers, batched per home replica. ``read`` returns
    what ``finish(dest)`` returned (the chunk's hash), or raises the chunk's typed
    error (``ChunkNotFound``, ``ChunkSizeMismatch``, or the batch's own failure)."""

    def __init__(self, read_many: ReadMany, home: Callable[[str], str],
                 finish: Callable[[memoryview], str], lanes: int = LANES,
                 most: int = MOST, alone: Callable[[], bool] = lambda: False,
                 watch: Watch | None = None) -> None:
        self._read_many = read_many
        self._watch = watch
        self._home = home
        self._finish = finish
        #: whether the store is one server: a read it let time out has no replica
        #: to go to (asking it again costs another whole timeout per try)
        self.alone = alone
        self.lanes = max(1, lanes)
        self.most = max(1, min(most, MAX_CHUNK_READ))
        self._waiting: dict[str, list[_Read]] = {}
        self._busy: dict[str, int] = {}
        self._due: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.lanes * 4, thread_name_prefix="ckptd-store-read")
        self.requests = 0  # batches sent (tests count them)
        # The server answered a batch with an error of its own: read one by one.
        self.refused = False

    async def read(self, cid: str, dest: memoryview) -> str:
        loop = asyncio.get_running_loop()
        one = _Read(cid, dest, loop.create_future())
        home = self._home(cid)
        self._waiting.setdefault(home, []).append(one)
        self._pump(home)
        try:
            return await asyncio.shield(one.future)
        except asyncio.CancelledError:
            waiting = self._waiting.get(home, [])
            if one in waiting:  # not sent yet: nothing will touch ``dest``
                waiting.remove(one)
                raise
            # As ``in_thread``: not before the thread is done with ``dest`` (a request
            # has a deadline of its own, ``PeerClient``).
            await asyncio.wait([one.future])
            raise

    def _pump(self, home: str) -> None:
        if home not in self._due and self._busy.get(home, 0) < self.lanes:
            # At the next turn: the reads that come in during this one go with it.
            self._due.add(home)
            asyncio.get_running_loop().call_soon(self._send, home)

    def _send(self, home: str) -> None:
        self._due.discard(home)
        waiting = self._waiting.get(home, [])
        free = self.lanes - self._busy.get(home, 0)
        while waiting and free > 0:
            # Spread over the free lanes: two half batches overlap, one whole does not.
            n = min(self.most, -(-len(waiting) // free))
            batch, waiting[:n] = waiting[:n], []
            self._busy[home] = self._busy.get(home, 0) + 1
            free -= 1
            self.requests += 1
            asyncio.get_running_loop().create_task(self._run(home, batch))

    async def _run(self, home: str, batch: list[_Read]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with (self._watch(home) if self._watch is not None
                        else contextlib.nullcontext()):
                await loop.run_in_executor(self._pool, self._read_batch, loop, home, batch)
        except BaseException as exc:
            # The request failed as a whole: every read it had not handed back yet
            # fails with its error (the thread is done with their buffers). An error
            # answer to the request itself (a server without the route) ends batching.
            if isinstance(exc, CkptdError) and not isinstance(exc, Unavailable):
                self.refused = True
            for one in batch:
                if not one.settled:
                    one.settled = True
                    _settle(one.future, None, exc if isinstance(exc, Exception)
                            else CkptdError(f"chunk read stopped: {exc!r}"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._busy[home] -= 1
            self._pump(home)

    def _read_batch(self, loop: asyncio.AbstractEventLoop, home: str,
                    batch: list[_Read]) -> None:
        def each(i: int, error: CkptdError | None) -> None:
            one = batch[i]
            result: str | None = None
            failure: BaseException | None = error
            if error is None:
                try:
                    result = self._finish(one.dest)  # in this thread, while in cache
                except Exception as exc:
                    failure = exc
            one.settled = True
            loop.call_soon_threadsafe(_settle, one.future, result, failure)

        self._read_many(home, [(one.cid, one.dest) for one in batch], each)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(future: asyncio.Future[str], result: str | None,
            error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)
