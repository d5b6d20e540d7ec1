"""``BatchedChunkReads``: a read whose caller is cancelled before its batch is sent
is dropped at once and never sent (found by review: it went out later, and the
cancelled restore waited for a whole batch nobody wanted)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

from ckptd.client.transport_reads import BatchedChunkReads
from ckptd.errors import CkptdError


def test_a_cancelled_read_that_was_not_sent_is_dropped_at_once() -> None:
    release = threading.Event()
    sent: list[list[str]] = []

    def read_many(url: str, chunks: Sequence[tuple[str, memoryview]],
                  each: Callable[[int, CkptdError | None], None]) -> None:
        sent.append([cid for cid, _ in chunks])
        release.wait(30)
        for i in range(len(chunks)):
            each(i, None)

    async def scenario() -> None:
        reads = BatchedChunkReads(read_many, lambda cid: "http://replica",
                                  lambda dest: "hash", lanes=1)
        first = asyncio.ensure_future(reads.read("a" * 64, memoryview(bytearray(4))))
        await asyncio.sleep(0.2)  # the first batch is in flight; the lane is busy
        second = asyncio.ensure_future(reads.read("b" * 64, memoryview(bytearray(4))))
        await asyncio.sleep(0.1)
        second.cancel()
        done, _ = await asyncio.wait([second], timeout=2)
        assert second in done, "the cancelled read waited for the batch in flight"
        release.set()
        assert await first == "hash"
        await asyncio.sleep(0.2)
        assert sent == [["a" * 64]]  # the dropped read never went out
        reads.close()

    asyncio.run(scenario())
