"""The background side of the client: a thread with its own asyncio loop where the
transport lives, and the snapshot pipeline (hash, ask what is missing, upload, put
the manifest, commit). Restores run on the same loop (``restore.py``).

The pipeline reads the staging pool in place: chunks are slices of the pool's
mapping, hashed by blake3 in worker threads (it releases the GIL) and handed to the
transport as memoryviews. It never cancels work that may still read the pool (see
``bounded``), so a finished snapshot future means the pool is free to overwrite.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ckptd import knobs
from ckptd.errors import (
    CkptdError,
    Timeout,
    Unavailable,
)
from ckptd.format import EPOCH_META, Placement, RankManifest, TensorEntry
from ckptd.hashing import chunk_count, chunk_id, chunk_spans

from .staging import StagedPiece, TensorInfo
from .state import dtype_name
from .transport import Transport

log = logging.getLogger(__name__)

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


# -- save -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What a finished snapshot did.

    ``state`` is "committed" when the step is committed (every rank is in), or
    "pending" when this rank's manifest is stored and other ranks are still to come.
    ``bytes_deduplicated`` is what this rank did not send because the store already
    had it, another replica sent it, or it repeated within the snapshot."""

    step: int
    state: Literal["committed", "pending"]
    bytes_staged: int
    bytes_sent: int
    bytes_deduplicated: int
    chunks_total: int
    chunks_sent: int
    stage_seconds: float
    upload_seconds: float
    total_seconds: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One save, as the pipeline needs it: what the manifest says besides chunk ids."""

    job: str
    step: int
    rank: int
    world_size: int
    chunk_size: int
    tree: dict[str, Any]
    tensors: Sequence[TensorInfo]
    placements: dict[str, tuple[Placement, list[int], list[int]]]  # placement, global, offsets
    meta: dict[str, Any]
    started: float  # time.perf_counter() when save() was called
    # The job's timeline this rank was in at save(), when it was not known yet:
    # the answer to the checkpointer's construction-time question, awaited here,
    # off the training thread, and stamped on the manifest.
    epoch_pending: concurrent.futures.Future[int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


_HASH_BATCH_BYTES = 16 << 20  # one worker's share of a span, in whole chunks
_PLACEHOLDER_ID = "0" * 64


def _hash_jobs(piece: StagedPiece, chunk_size: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(span number, first chunk number in the span, byte ranges) per hashing job."""
    per_job = max(1, _HASH_BATCH_BYTES // chunk_size)
    jobs = []
    for k, span in enumerate(piece.spans):
        ranges = list(chunk_spans(span.end - span.start, chunk_size))
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
            answer = await transport.missing_chunks(ids[i : i + batch], claimer)
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


async def _hash_piece(piece: StagedPiece, chunk_size: int) -> list[list[str]]:
    """The chunk ids of every span of a staged piece, hashed in worker threads
    straight from the pool (slices of its mapping: no copy). Chunks from
    ``knobs.hash_threads_threshold()`` up also use blake3's own threads."""
    ids: list[list[str]] = [
        [""] * len(range(0, s.end - s.start, chunk_size)) for s in piece.spans
    ]

    async def one(job: tuple[int, int, list[tuple[int, int]]]) -> None:
        k, first, ranges = job
        data = piece.spans[k].data

        def run() -> list[str]:
            return [chunk_id(data[a:b]) for a, b in ranges]

        ids[k][first : first + len(ranges)] = await asyncio.to_thread(run)

    await bounded(_hash_jobs(piece, chunk_size), one, min(4, os.cpu_count() or 2))
    return ids


class SnapshotUpload:
    """One snapshot's way to the repository, fed staged pieces in order: each is
    hashed, the ids it holds are asked for in one batched missing-chunks call
    (claiming them), only the missing ones are sent, and chunks other replicas
    claimed are waited for. ``finish`` takes the last piece, then puts the rank
    manifest and commits.

    When ``send`` returns, nothing reads the piece's buffers any more: the caller
    may stage the next piece over it."""

    def __init__(
        self, transport: Transport, snap: Snapshot, pieces: int = 1, poll: float = 0.05
    ) -> None:
        self.transport = transport
        self.snap = snap
        self.pieces = pieces
        self.poll = poll
        self.claimer = f"{snap.job}/{snap.rank}"
        self._ids: list[list[str]] = [
            [""] * chunk_count(t.nbytes, snap.chunk_size) for t in snap.tensors
        ]
        self._handled: set[str] = set()  # ids sent or found present by an earlier piece
        self.chunks_sent = 0
        self.bytes_sent = 0
        self.stage_seconds = 0.0
        self._t0: float | None = None

    def _manifest(self) -> RankManifest:
        snap = self.snap
        entries = []
        for t, ids in zip(snap.tensors, self._ids, strict=True):
            placement, global_shape, offsets = snap.placements[t.name]
            entries.append(
                TensorEntry(
                    name=t.name,
                    dtype=dtype_name(t.dtype),
                    placement=placement,
                    global_shape=global_shape,
                    offsets=offsets,
                    shape=list(t.shape),
                    nbytes=t.nbytes,
                    chunks=[cid or _PLACEHOLDER_ID for cid in ids],
                )
            )
        return RankManifest(
            job=snap.job,
            step=snap.step,
            rank=snap.rank,
            world_size=snap.world_size,
            chunk_size=snap.chunk_size,
            entries=entries,
            tree=snap.tree,
            meta=snap.meta,
        )

    async def _hash(self, piece: StagedPiece) -> dict[str, memoryview]:
        """Hashes a piece, records its ids; the chunks no earlier piece handled."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
            if self.pieces > 1:
                # Chunks go out before the manifest is whole: check what it says about
                # itself first, so a bad state sends nothing.
                self._manifest().check()
        if not piece.copied:
            await asyncio.to_thread(piece.wait_copied)  # the GPU copy-done event
        self.stage_seconds += piece.seconds
        ids = await _hash_piece(piece, self.snap.chunk_size)
        await asyncio.to_thread(piece.publish, ids)  # the index: a JSON file in the pool
        data: dict[str, memoryview] = {}
        cs = self.snap.chunk_size
        for span, span_ids in zip(piece.spans, ids, strict=True):
            first = span.start // cs
            self._ids[span.index][first : first + len(span_ids)] = span_ids
            for k, cid in enumerate(span_ids):
                if cid not in self._handled and cid not in data:
                    data[cid] = span.data[k * cs : (k + 1) * cs]
        return data

    async def _upload(self, data: dict[str, memoryview]) -> None:
        sent, nbytes = await upload_missing(
            self.transport, data, self.claimer, poll=self.poll, what=f"step {self.snap.step}"
        )
        self.chunks_sent += sent
        self.bytes_sent += nbytes
        self._handled.update(data)

    def chunks_of(self, piece: StagedPiece) -> dict[str, memoryview]:
        """Chunk id -> its bytes in the pool, for every chunk of a hashed piece:
        what a peer server may serve while the pool still holds them."""
        cs = self.snap.chunk_size
        out: dict[str, memoryview] = {}
        for span in piece.spans:
            first = span.start // cs
            n = chunk_count(span.end - span.start, cs)
            for k, cid in enumerate(self._ids[span.index][first : first + n]):
                if cid:
                    out.setdefault(cid, span.data[k * cs : (k + 1) * cs])
        return out

    async def send(self, piece: StagedPiece) -> None:
        """Hashes and uploads one piece that is not the last."""
        await self._upload(await self._hash(piece))

    async def _stamp_epoch(self) -> None:
        pending = self.snap.epoch_pending
        if pending is None or EPOCH_META in self.snap.meta:
            return
        try:
            epoch = await asyncio.wrap_future(pending)
        except CkptdError:
            raise  # typed already (unauthorized, unavailable, ...)
        except Exception as exc:
            raise Unavailable(
                f"snapshot of step {self.snap.step}: cannot learn the job's timeline: {exc}"
            ) from exc
        if epoch:
            self.snap.meta[EPOCH_META] = epoch

    async def finish(self, piece: StagedPiece) -> SaveResult:
        """Hashes and uploads the last piece, puts the manifest, commits."""
        await self._stamp_epoch()
        data = await self._hash(piece)
        manifest = self._manifest()
        if self.pieces == 1:
            manifest.check()  # a bad manifest fails here, before any byte is sent
        await self._upload(data)
        if any(not cid for ids in self._ids for cid in ids):
            raise CkptdError(f"snapshot of step {self.snap.step}: some chunks were never staged")
        snap = self.snap
        await self.transport.put_manifest(manifest)
        status = await self.transport.commit(snap.job, snap.step, snap.meta or None)
        now = time.perf_counter()
        upload_seconds = now - (self._t0 if self._t0 is not None else now)
        total = now - snap.started
        chunks_total = len({cid for ids in self._ids for cid in ids})
        log.info(
            "%s step %d %s: %d bytes staged in %d piece(s), %d sent in %d of %d chunks, "
            "%.3f s", self.claimer, snap.step, status.state, snap.nbytes, self.pieces,
            self.bytes_sent, self.chunks_sent, chunks_total, total,
        )
        return SaveResult(
            step=snap.step,
            state=status.state,
            bytes_staged=snap.nbytes,
            bytes_sent=self.bytes_sent,
            bytes_deduplicated=snap.nbytes - self.bytes_sent,
            chunks_total=chunks_total,
            chunks_sent=self.chunks_sent,
            stage_seconds=self.stage_seconds,
            upload_seconds=upload_seconds,
            total_seconds=total,
        )


def wrap_error(exc: BaseException, what: str) -> CkptdError:
    """A typed error for anything that went wrong in the background."""
    if isinstance(exc, CkptdError):
        return exc
    err = CkptdError(f"{what} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
