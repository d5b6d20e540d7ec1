"""A snapshot's upload: hash each staged piece, ask what is missing, upload it,
put the manifest, commit; and what a finished snapshot did (``SaveResult``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ckptd.errors import CkptdError, Conflict, Unavailable
from ckptd.format import EPOCH_META, Placement, RankManifest, TensorEntry, manifest_epoch
from ckptd.hashing import chunk_count

from ..dtypes import dtype_name
from ..loop import in_thread
from ..staging.layout import StagedPiece, TensorInfo
from ..transport import Transport
from .chunks import _hash_piece, upload_missing

log = logging.getLogger(__name__)


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
    # The manifest this checkpointer put for this step before (a coordinated
    # snapshot, then the loop's own save): the same state again is that save.
    earlier: RankManifest | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


_PLACEHOLDER_ID = "0" * 64


class SnapshotUpload:
    """One snapshot's way to the repository, fed staged pieces in order: each is
    hashed, the ids it holds are asked for in one batched missing-chunks call
    (claiming them), only the missing ones are sent, and chunks other replicas
    claimed are waited for. ``finish`` takes the last piece, then puts the rank
    manifest and commits.

    When ``send`` returns, nothing reads the piece's buffers any more: the caller
    may stage the next piece over it."""

    def __init__(
        self, transport: Transport, snap: Snapshot, pieces: int = 1, poll: float = 0.05,
        on_manifest: Callable[[RankManifest], None] | None = None,
    ) -> None:
        self.transport = transport
        self.snap = snap
        # Told of the manifest once it is stored (before the commit is asked).
        self.on_manifest = on_manifest
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
            await in_thread(piece.wait_copied)  # the GPU copy-done event
        self.stage_seconds += piece.seconds
        ids = await _hash_piece(piece, self.snap.chunk_size)
        await in_thread(piece.publish, ids)  # the index: a JSON file in the pool
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
        repeat = same_save(self.snap.earlier, manifest)  # raises for other bytes
        await self._upload(data)
        if any(not cid for ids in self._ids for cid in ids):
            raise CkptdError(f"snapshot of step {self.snap.step}: some chunks were never staged")
        snap = self.snap
        if repeat is None:
            await self.transport.put_manifest(manifest)
        else:  # the state saved before: that manifest stands (its meta, its reason)
            manifest = repeat
        if self.on_manifest is not None:
            self.on_manifest(manifest)
        status = await self.transport.commit(snap.job, snap.step, manifest.meta or None)
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



def same_save(earlier: RankManifest | None, manifest: RankManifest) -> RankManifest | None:
    """``earlier`` when ``manifest`` saves the same state of the same step (its meta
    aside: a coordinated snapshot's reason, the loop's own): one save, whose manifest
    stands. None when there is no earlier save of this step in this timeline. Raises
    ``Conflict`` for other bytes: a stored manifest never changes, so the first save
    stands and this one must store nothing."""
    if earlier is None or (earlier.job, earlier.step, earlier.rank) != (
            manifest.job, manifest.step, manifest.rank):
        return None
    if manifest_epoch(earlier) != manifest_epoch(manifest):
        return None  # saved before a rollback: the new timeline's manifest replaces it
    if (earlier.entries == manifest.entries and earlier.tree == manifest.tree
            and earlier.world_size == manifest.world_size
            and earlier.chunk_size == manifest.chunk_size):
        return earlier
    before = {e.name: e for e in earlier.entries}
    now = {e.name: e for e in manifest.entries}
    names = sorted(n for n in before.keys() | now.keys() if before.get(n) != now.get(n))
    what = [repr(n) for n in names[:5]] + (["..."] if len(names) > 5 else [])
    if earlier.tree != manifest.tree:
        what.append("plain values")
    if earlier.world_size != manifest.world_size or earlier.chunk_size != manifest.chunk_size:
        what.append("world size or chunk size")
    raise Conflict(
        f"this rank saved step {manifest.step} before with other bytes ({', '.join(what)} "
        "differ): a stored manifest never changes, so the first save stands and this one "
        "stored nothing. Save a changed state under another step number; when ckpt.step() "
        "took a coordinated snapshot of this step first, call save() before step(), as the "
        "README's loop does: the snapshot is then that save",
        job=manifest.job, step=manifest.step, rank=manifest.rank, names=names[:100])
