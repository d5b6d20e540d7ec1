"""Hashing a staged piece's chunks where they lie in the pool, and uploading the
ones the store lacks."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence

from ckptd import knobs
from ckptd.hashing import chunk_id, chunk_spans

from ..loop import bounded, in_thread
from ..staging.layout import StagedPiece
from ..transport import Transport

log = logging.getLogger(__name__)


_HASH_BATCH_BYTES = 16 << 20  # one worker's share of a span, in whole chunks
# Seconds a missing-chunks call may wait for its answer before the rank's log says
# so: a server holds it while a garbage collection sweeps (up to two minutes, and
# a killed collector's sweep that long), and the rank's log was silent meanwhile.
SLOW_ANSWER_S = 10.0


def _hash_jobs(sizes: Sequence[int], chunk_size: int
               ) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(view number, first chunk number in the view, byte ranges) per hashing job."""
    per_job = max(1, _HASH_BATCH_BYTES // chunk_size)
    jobs = []
    for k, size in enumerate(sizes):
        ranges = list(chunk_spans(size, chunk_size))
        for i in range(0, len(ranges), per_job):
            jobs.append((k, i, ranges[i : i + per_job]))
    return jobs


async def upload_missing(
    transport: Transport,
    data: Mapping[str, memoryview],
    claimer: str,
    *,
    poll: float = 0.05,
    what: str = "",
) -> tuple[int, int]:
    """Sends the chunks of ``data`` the store lacks (claiming them for ``claimer``)
    and waits for those another replica claimed; returns (chunks, bytes) sent.

    The buffers in ``data`` stay the caller's until this returns: a claim that
    lapses comes back missing, to us, and then we send it."""
    sent = [0, 0]

    async def upload(cid: str) -> None:
        chunk = data[cid]
        await transport.put_chunk(cid, chunk)
        sent[0] += 1
        sent[1] += len(chunk)

    async def ask(ids: list[str]) -> list[str]:
        """Sends what is missing among ``ids``; returns those in flight elsewhere."""
        waiting: list[str] = []
        batch = knobs.missing_batch()
        for i in range(0, len(ids), batch):
            said = asyncio.get_running_loop().call_later(SLOW_ANSWER_S, _say_slow, claimer, what)
            try:
                answer = await transport.missing_chunks(ids[i : i + batch], claimer)
            finally:
                said.cancel()
            await bounded(answer.missing, upload, knobs.upload_concurrency())
            waiting.extend(answer.in_flight)
        return waiting

    in_flight = await ask(list(data))
    delay = poll
    while in_flight:
        # Another replica claimed these and is sending them. Ask again: sent ones
        # are gone from the answer, and a claim that lapsed comes back missing.
        log.debug("%s %s: waiting for %d chunks another replica sends",
                  claimer, what, len(in_flight))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
        in_flight = await ask(in_flight)
    return sent[0], sent[1]


def _say_slow(claimer: str, what: str) -> None:
    log.warning("%s %s: the server has not said which chunks it lacks for %.0f s: a "
                "garbage collection's sweep holds saves until it ends (up to 2 min; `ckptd "
                "status` shows it), or the server or its store is slow", claimer, what,
                SLOW_ANSWER_S)


async def hash_views(views: Sequence[memoryview], chunk_size: int) -> list[list[str]]:
    """The chunk ids of each view's bytes (cut at ``chunk_size``; an empty view has
    one empty chunk), hashed in worker threads where the bytes lie (no copy).
    Chunks from ``knobs.hash_threads_threshold()`` up also use blake3's own threads."""
    ids: list[list[str]] = [[""] * len(range(0, len(v), chunk_size)) for v in views]

    async def one(job: tuple[int, int, list[tuple[int, int]]]) -> None:
        k, first, ranges = job
        data = views[k]

        def run() -> list[str]:
            return [chunk_id(data[a:b]) for a, b in ranges]

        ids[k][first : first + len(ranges)] = await in_thread(run)

    await bounded(_hash_jobs([len(v) for v in views], chunk_size), one,
                  min(4, os.cpu_count() or 2))
    return ids


async def _hash_piece(piece: StagedPiece, chunk_size: int) -> list[list[str]]:
    """The chunk ids of every span of a staged piece, straight from the pool."""
    return await hash_views([s.data for s in piece.spans], chunk_size)
