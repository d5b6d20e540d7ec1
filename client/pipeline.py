"""The background side of the client: a thread with its own asyncio loop where the
transport lives, the snapshot pipeline (hash, ask what is missing, upload, put the
manifest, commit) and the restore fetch (download, verify, assemble).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from ckptd import knobs
from ckptd.errors import (
    ChunkHashMismatch,
    ChunkNotFound,
    ChunkSizeMismatch,
    CkptdError,
    RestoreError,
    Timeout,
)
from ckptd.format import Placement, RankManifest, TensorEntry
from ckptd.hashing import chunk_id, chunk_spans

from .staging import StagedTensor
from .state import byte_view, dtype_name, torch_dtype
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
    """Runs ``fn`` over ``items`` with at most ``limit`` at once; on the first error
    the rest are cancelled and that error is raised."""
    it = iter(items)

    async def worker() -> None:
        for item in it:  # one shared iterator: each item goes to one worker
            await fn(item)

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, limit))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
    """One staged save, ready for the pipeline."""

    job: str
    step: int
    rank: int
    world_size: int
    chunk_size: int
    tree: dict[str, Any]
    tensors: Sequence[StagedTensor]
    placements: dict[str, tuple[Placement, list[int], list[int]]]  # placement, global, offsets
    meta: dict[str, Any]
    bytes_staged: int
    stage_seconds: float
    started: float  # time.perf_counter() when save() was called


@dataclass(slots=True)
class _Hashed:
    entries: list[TensorEntry] = field(default_factory=list)
    data: dict[str, memoryview] = field(default_factory=dict)  # unique chunk id -> bytes


def _hash_tensor(staged: StagedTensor, chunk_size: int) -> list[tuple[str, memoryview]]:
    view = byte_view(staged.buffer)
    return [
        (chunk_id(view[a:b]), view[a:b]) for a, b in chunk_spans(len(view), chunk_size)
    ]


async def _hash_snapshot(snap: Snapshot) -> _Hashed:
    """Chunks and hashes every staged tensor in worker threads (blake3 frees the GIL)."""
    out = _Hashed()
    results: dict[str, list[tuple[str, memoryview]]] = {}

    async def one(staged: StagedTensor) -> None:
        results[staged.name] = await asyncio.to_thread(_hash_tensor, staged, snap.chunk_size)

    # Big chunks already use blake3's own threads; the workers cover many small tensors.
    await bounded(snap.tensors, one, min(8, os.cpu_count() or 2))
    for staged in snap.tensors:
        chunks = results[staged.name]
        placement, global_shape, offsets = snap.placements[staged.name]
        out.entries.append(
            TensorEntry(
                name=staged.name,
                dtype=dtype_name(staged.buffer.dtype),
                placement=placement,
                global_shape=global_shape,
                offsets=offsets,
                shape=list(staged.buffer.shape),
                nbytes=staged.nbytes,
                chunks=[cid for cid, _ in chunks],
            )
        )
        for cid, data in chunks:
            out.data.setdefault(cid, data)
    return out


async def run_snapshot(transport: Transport, snap: Snapshot, poll: float = 0.05) -> SaveResult:
    """Uploads one staged snapshot: hash, ask what is missing (claiming it), send
    that, wait for what other replicas are sending, put the manifest, commit."""
    t0 = time.perf_counter()
    hashed = await _hash_snapshot(snap)
    manifest = RankManifest(
        job=snap.job,
        step=snap.step,
        rank=snap.rank,
        world_size=snap.world_size,
        chunk_size=snap.chunk_size,
        entries=hashed.entries,
        tree=snap.tree,
        meta=snap.meta,
    )
    manifest.check()  # a bad manifest fails here, before any byte is sent
    claimer = f"{snap.job}/{snap.rank}"
    ids = list(hashed.data)
    sent = {"chunks": 0, "bytes": 0}

    async def upload(cid: str) -> None:
        data = hashed.data[cid]
        await transport.put_chunk(cid, data)
        sent["chunks"] += 1
        sent["bytes"] += len(data)

    async def ask(batch_ids: list[str]) -> list[str]:
        """Sends what is missing among ``batch_ids``; returns those in flight elsewhere."""
        waiting: list[str] = []
        batch = knobs.missing_batch()
        for i in range(0, len(batch_ids), batch):
            answer = await transport.missing_chunks(batch_ids[i : i + batch], claimer)
            await bounded(answer.missing, upload, knobs.upload_concurrency())
            waiting.extend(answer.in_flight)
        return waiting

    in_flight = await ask(ids)
    delay = poll
    while in_flight:
        # Another replica claimed these and is sending them. Ask again: sent ones are
        # gone from the answer, and a claim that lapsed comes back missing, to us.
        log.debug("%s step %d: waiting for %d chunks another replica sends",
                  claimer, snap.step, len(in_flight))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
        in_flight = await ask(in_flight)

    await transport.put_manifest(manifest)
    status = await transport.commit(snap.job, snap.step, snap.meta or None)
    upload_seconds = time.perf_counter() - t0
    total = time.perf_counter() - snap.started
    log.info(
        "%s step %d %s: %d bytes staged, %d sent in %d of %d chunks, %.3f s",
        claimer, snap.step, status.state, snap.bytes_staged, sent["bytes"], sent["chunks"],
        len(ids), total,
    )
    return SaveResult(
        step=snap.step,
        state=status.state,
        bytes_staged=snap.bytes_staged,
        bytes_sent=sent["bytes"],
        bytes_deduplicated=snap.bytes_staged - sent["bytes"],
        chunks_total=len(ids),
        chunks_sent=sent["chunks"],
        stage_seconds=snap.stage_seconds,
        upload_seconds=upload_seconds,
        total_seconds=total,
    )


# -- restore ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fetched:
    """Every tensor of a rank manifest, assembled from verified chunks."""

    tensors: dict[str, torch.Tensor]
    nbytes: int
    chunks: int
    bytes_from: dict[str, int]


async def fetch_manifest(
    transport: Transport, manifest: RankManifest, concurrency: int | None = None
) -> Fetched:
    """Downloads every chunk a manifest names, verifies each against its id on
    arrival, and assembles the tensors into fresh CPU buffers.

    Nothing is returned unless every chunk verified: ``ChunkHashMismatch`` for bytes
    that do not hash to their id, ``ChunkSizeMismatch`` for a chunk of the wrong
    length, ``RestoreError`` for chunks the store lacks; each names the entries."""
    tensors: dict[str, torch.Tensor] = {}
    # chunk id -> every (entry name, destination view) it fills
    targets: dict[str, list[tuple[str, memoryview]]] = {}
    for e in manifest.entries:
        buf = torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype))
        tensors[e.name] = buf
        view = byte_view(buf)
        if len(view) != e.nbytes:
            raise RestoreError(f"entry {e.name!r}: {len(view)} bytes, manifest says {e.nbytes}")
        spans = list(chunk_spans(e.nbytes, manifest.chunk_size))
        for cid, (a, b) in zip(e.chunks, spans, strict=True):
            targets.setdefault(cid, []).append((e.name, view[a:b]))
    received = {"bytes": 0}

    async def fetch(cid: str) -> None:
        names = sorted({name for name, _ in targets[cid]})
        try:
            data = await transport.get_chunk(cid)
        except ChunkNotFound as exc:
            raise RestoreError(
                f"chunk {cid} of {', '.join(map(repr, names[:5]))} is not in the store",
                id=cid, entries=names[:50],
            ) from exc
        actual = await asyncio.to_thread(chunk_id, data)
        if actual != cid:
            raise ChunkHashMismatch(
                f"chunk {cid} of {', '.join(map(repr, names[:5]))} arrived corrupt "
                f"(hashes to {actual})",
                id=cid, actual=actual, entries=names[:50],
            )
        for name, dest in targets[cid]:
            if len(dest) != len(data):
                raise ChunkSizeMismatch(
                    f"chunk {cid} of {name!r} has {len(data)} bytes, expected {len(dest)}",
                    id=cid, entries=[name],
                )
            dest[:] = data
        received["bytes"] += len(data)

    await bounded(list(targets), fetch, concurrency or knobs.upload_concurrency())
    return Fetched(
        tensors=tensors,
        nbytes=manifest.nbytes,
        chunks=len(targets),
        bytes_from={"store": received["bytes"]},
    )


def wrap_error(exc: BaseException, what: str) -> CkptdError:
    """A typed error for anything that went wrong in the background."""
    if isinstance(exc, CkptdError):
        return exc
    err = CkptdError(f"{what} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
