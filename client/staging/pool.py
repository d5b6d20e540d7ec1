"""``StagingPool``: the reusable shared memory that holds one staged copy of a
rank's tensors (the package docstring tells the design)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from ckptd.errors import InvalidRequest, StagingError
from ckptd.knobs import shm_dir

from .. import cuda
from .format import (
    CONTROL_NAME,
    GEN_AT,
    PID_AT,
)
from .index import index_doc, write_index
from .layout import (
    PAGE,
    SEGMENT_GRAIN,
    StagedPiece,
    StagedSpan,
    StagePlan,
    TensorInfo,
    _align,
    _alignment,
    _copy,
    _footprint,
    _Layout,
    _pack_sequential,
    _Placed,
)
from .reader import StagedPoolReader, _owner_pid, _remove_if_stale
from .segments import (
    _LIVE,
    PoolStats,
    _create_segment,
    _open_control,
    _read_generation,
    _Resources,
    _Segment,
    own_user_root,
    pool_dir,
)

log = logging.getLogger(__name__)


_KEEP_FACTOR = 1.5  # rebuild the pool when it is this much larger than the state
_CLAIM_RETRIES = 10  # tries on a rank's own pool whose lock is held, _CLAIM_WAIT_S apart
_CLAIM_WAIT_S = 0.005


class StagingPool:
    """Reusable, file-backed shared memory that holds one staged copy of a rank's
    tensors (see the module docstring for the design)."""

    def __init__(
        self,
        job: str,
        rank: int,
        *,
        root: str | os.PathLike[str] | None = None,
        budget: int | None = None,
    ) -> None:
        if budget is not None and budget < PAGE:
            raise InvalidRequest(f"staging budget {budget} is below one page ({PAGE} bytes)")
        self.job = job
        self.rank = int(rank)
        self.root = shm_dir() if root is None else Path(root)
        self.budget = None if budget is None else int(budget)
        self.stats = PoolStats()
        self._tag = f"{os.getpid():x}{secrets.token_hex(3)}"
        self._serial = 0
        self._segments: list[_Segment] = []
        self._layout: _Layout | None = None
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._took_over = False
        self._max_need = 0
        self._pin_device: torch.device | None = None
        self._streams: cuda.CopyStreams | None = None
        self._index_key: tuple[int, int] | None = None
        self._closed = False
        self.directory, fd, control = self._claim()
        self._control = control
        self._res = _Resources(self.directory, fd, control)
        _LIVE.add(self._res)
        self._finalizer = weakref.finalize(self, self._res.release)
        self._finalizer.atexit = False  # our own atexit hook decides what an exit keeps
        struct.pack_into("<Q", control, PID_AT, os.getpid())

    def _claim(self) -> tuple[Path, int, mmap.mmap]:
        primary = pool_dir(self.job, self.rank, self.root)
        candidates = [primary] + [
            primary.with_name(f"{primary.name}.{os.getpid()}-{secrets.token_hex(3)}")
            for _ in range(3)
        ]
        for i, directory in enumerate(candidates):
            # A dead pool's lock is held for a moment by whoever probes or removes it
            # (``ckptd shm``, remove_stale_pools): wait that out on the rank's own
            # name before taking a sibling that a restart would not find.
            waits = _CLAIM_RETRIES if i == 0 else 0
            vanished = 0
            while True:
                try:
                    # Each level made here, private: a clean removes the user's and the
                    # job's directories once empty, and may do so between two mkdirs.
                    own_user_root(self.root)  # (StagingError when another user made it)
                    directory.parent.mkdir(exist_ok=True, mode=0o700)
                    directory.mkdir(exist_ok=True, mode=0o700)
                    opened = _open_control(directory, lock=True)
                except (FileNotFoundError, FileExistsError):
                    # A closing owner or a clean removed it under us (FileExistsError:
                    # mkdir found it, then it was gone before pathlib saw a directory).
                    vanished += 1
                    if vanished == 5:
                        raise StagingError(
                            f"cannot create the staging directory {directory}") from None
                    continue
                if opened is not None or waits == 0:
                    break
                waits -= 1
                time.sleep(_CLAIM_WAIT_S)
            if opened is not None:
                if i:
                    owner = _owner_pid(primary)
                    who = ("by another pool of this process (a second Checkpointer for "
                           "the same job and rank)" if owner == os.getpid()
                           else f"by another live process (pid {owner})")
                    log.warning("staging: %s is in use %s; staging into %s, which a "
                                "restart will not find", primary, who, directory.name)
                return directory, opened[0], opened[1]
        raise StagingError(f"no free staging directory next to {primary}")

    # -- observing ----------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<StagingPool {self.directory} {self.stats.bytes_mapped} bytes mapped>"

    @property
    def nbytes(self) -> int:
        """Bytes mapped now."""
        return self.stats.bytes_mapped

    @property
    def generation(self) -> int:
        """The seqlock generation: odd while a stage overwrites the buffers."""
        return _read_generation(self._control)

    @property
    def _buffers(self) -> dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor]:
        """Each whole-staged tensor's view in the pool, keyed by (name, shape, dtype)."""
        layout = self._layout
        if layout is None or len(layout.pieces) != 1:
            return {}
        out = {}
        infos: list[TensorInfo] = layout.key[1]
        for p in layout.pieces[0]:
            info = infos[p.index]
            if p.start == 0 and p.end == info.nbytes:
                seg = self._segments[p.segment]
                view = seg.tensor[p.offset : p.offset + info.nbytes]
                out[(info.name, info.shape, info.dtype)] = view.view(info.dtype).view(info.shape)
        return out

    # -- the seqlock --------------------------------------------------------------------

    def _begin_write(self) -> int:
        with self._lock:
            g = self.generation
            g = g + 1 if g % 2 == 0 else g + 2
            struct.pack_into("<Q", self._control, GEN_AT, g)
            return g + 1  # the generation the buffers will have once the copies are done

    def _end_write(self, generation: int) -> None:
        with self._lock:
            if self.generation == generation - 1:
                struct.pack_into("<Q", self._control, GEN_AT, generation)

    # -- planning -----------------------------------------------------------------------

    def prepare(
        self, tensors: Sequence[tuple[str, torch.Tensor]], chunk_size: int
    ) -> StagePlan:
        """The layout for staging ``tensors`` (reused when it still fits, else built,
        growing or rebuilding the pool). Call only when no snapshot reads the pool."""
        if self._closed:
            raise InvalidRequest("this staging pool is closed")
        infos = []
        sources = []
        devices = set()
        for name, t in tensors:
            infos.append(TensorInfo(name, t.dtype, tuple(t.shape), t.nbytes))
            sources.append(t)
            if t.is_cuda:
                devices.add(t.device)
        if devices and not cuda.available():
            raise InvalidRequest("the state holds CUDA tensors but CUDA is not available")
        key = (chunk_size, infos)
        layout = self._layout
        if layout is None or layout.key != key:
            layout = self._plan(infos, chunk_size)
            self._layout = layout
            self.stats.layouts += 1
        dev_list = sorted(devices, key=lambda d: d.index or 0)
        if dev_list:
            self._pin_all(dev_list[0])
        return StagePlan(infos, sources, layout, chunk_size, dev_list)

    def _plan(self, infos: list[TensorInfo], chunk_size: int) -> _Layout:
        self._take_over()
        need = sum(_footprint(i.nbytes) for i in infos if i.nbytes)
        if self.budget is None or need <= self.budget:
            pieces = [self._plan_whole(infos, need)]
        else:
            pieces = self._plan_pieces(infos, chunk_size)
        self._views = {}
        return _Layout(key=(chunk_size, infos), pieces=pieces)

    def _plan_whole(self, infos: list[TensorInfo], need: int) -> list[_Placed]:
        """Every tensor whole, packed into the segments (growing them at most once)."""
        self._max_need = max(self._max_need, need)
        order = sorted((i for i, t in enumerate(infos) if t.nbytes), key=lambda i: -infos[i].nbytes)
        segs = sorted(self._segments, key=lambda s: -s.nbytes)
        cursor = {id(s): 0 for s in segs}
        where: dict[int, tuple[_Segment, int]] = {}
        leftover = []
        for i in order:
            n = infos[i].nbytes
            for s in segs:
                off = _align(cursor[id(s)], _alignment(n))
                if off + n <= s.nbytes:
                    where[i] = (s, off)
                    cursor[id(s)] = off + n
                    break
            else:
                leftover.append(i)
        extra = sum(_footprint(infos[i].nbytes) for i in leftover)
        total = sum(s.nbytes for s in segs) + (self._segment_size(extra) if extra else 0)
        # Segments a smaller state leaves unused are kept (a state that alternates
        # does not reallocate) while the pool stays within about one copy of the
        # largest state staged (or the budget).
        limit = (self.budget if self.budget is not None
                 else _KEEP_FACTOR * self._max_need + SEGMENT_GRAIN)
        if total > limit:
            unused = [s for s in segs if not cursor[id(s)]]
            if total - sum(s.nbytes for s in unused) > limit:
                # Packing around old segments would waste too much: one exact segment.
                self._drop(self._segments)
                if not need:
                    return []
                seg = self._new_segment(self._segment_size(need))
                return sorted(_pack_sequential(order, infos, seg, self._segments),
                              key=lambda p: p.index)
            self._drop(unused)
        placed = []
        for i, (s, off) in where.items():
            placed.append(_Placed(i, 0, infos[i].nbytes, self._segments.index(s), off))
        if leftover:
            seg = self._new_segment(self._segment_size(extra))
            placed += _pack_sequential(leftover, infos, seg, self._segments)
        placed.sort(key=lambda p: p.index)
        return placed

    def _plan_pieces(self, infos: list[TensorInfo], chunk_size: int) -> list[list[_Placed]]:
        """The state in order, split at chunk boundaries, in pieces of one segment of
        ``budget`` bytes."""
        assert self.budget is not None
        size = self.budget // PAGE * PAGE
        if size < chunk_size + PAGE:
            raise InvalidRequest(
                f"staging budget {self.budget} cannot hold one chunk of {chunk_size} bytes "
                f"(needs at least {chunk_size + PAGE})"
            )
        if len(self._segments) != 1 or self._segments[0].nbytes != size:
            self._drop(self._segments)
            self._new_segment(size)
        pieces: list[list[_Placed]] = []
        current: list[_Placed] = []
        cursor = 0
        for i, info in enumerate(infos):
            pos = 0
            while pos < info.nbytes:
                rest = info.nbytes - pos
                off = _align(cursor, _alignment(rest))
                room = size - off
                take = rest if rest <= room else max(0, room) // chunk_size * chunk_size
                if take == 0:
                    pieces.append(current)
                    current, cursor = [], 0
                    continue
                current.append(_Placed(i, pos, pos + take, 0, off))
                cursor = off + take
                pos += take
        pieces.append(current)
        return [p for p in pieces if p] or [[]]

    def _segment_size(self, nbytes: int) -> int:
        if self.budget is not None:
            return min(_align(nbytes, PAGE), self.budget)
        return _align(max(nbytes, 1), SEGMENT_GRAIN)

    def _new_segment(self, nbytes: int) -> _Segment:
        file = f"seg-{self._tag}-{self._serial}"
        self._serial += 1
        seg = _create_segment(self.directory, file, nbytes, self.stats)
        self._segments.append(seg)
        self._res.segments.append(seg)
        if self._pin_device is not None:
            seg.pinned = cuda.pin(seg.tensor.data_ptr(), seg.nbytes, self._pin_device)
        st = self.stats
        st.segments_created += 1
        st.bytes_allocated += nbytes
        st.bytes_mapped += nbytes
        st.peak_bytes_mapped = max(st.peak_bytes_mapped, st.bytes_mapped)
        return seg

    def _drop(self, segments: Sequence[_Segment]) -> None:
        doomed = list(segments)
        if not doomed:
            return
        self._views = {}  # they pin the mappings
        self._sync_copies()
        for seg in doomed:
            self._unpin(seg)
            self._segments.remove(seg)
            self._res.segments.remove(seg)
            if seg.path is not None:
                seg.path.unlink(missing_ok=True)
            seg.release()
            self.stats.segments_removed += 1
            self.stats.bytes_mapped -= seg.nbytes
        self._index_key = None

    def _take_over(self) -> None:
        """Before this pool first writes its own segments: removes what a dead owner
        of this directory left (readers that mapped it keep their mappings)."""
        if self._took_over:
            return
        self._took_over = True
        mine = {s.file for s in self._segments}
        for name in os.listdir(self.directory):
            if name != CONTROL_NAME and name not in mine:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    (self.directory / name).unlink()
        # Private siblings (rank-N.<pid>-<tag>) whose owners died are nobody's.
        prefix = pool_dir(self.job, self.rank, self.root).name + "."
        for sibling in self.directory.parent.iterdir():
            if sibling.name.startswith(prefix) and sibling != self.directory:
                _remove_if_stale(sibling)

    # -- CUDA ---------------------------------------------------------------------------

    def _pin_all(self, device: torch.device) -> None:
        if self._pin_device is None:
            self._pin_device = device
            self._streams = cuda.CopyStreams()
        for seg in self._segments:
            if not seg.pinned:
                seg.pinned = cuda.pin(seg.tensor.data_ptr(), seg.nbytes, self._pin_device)

    def _unpin(self, seg: _Segment) -> None:
        if seg.pinned:
            cuda.unpin(seg.tensor.data_ptr(), self._pin_device)
            seg.pinned = False

    def _sync_copies(self) -> None:
        if self._streams is not None:
            self._streams.synchronize()

    # -- staging ------------------------------------------------------------------------

    def stage(self, plan: StagePlan, number: int, step: int | None = None) -> StagedPiece:
        """Copies piece ``number`` of ``plan`` into the pool.

        On the CPU the copies are done on return. With CUDA sources they are enqueued
        on the side streams after the work already queued on the current streams;
        ``StagedPiece.copy_done`` says when they finish. The caller makes sure no
        snapshot still reads the pool."""
        t0 = time.perf_counter()
        layout = plan.layout
        placed = layout.pieces[number]
        generation = self._begin_write()
        self._write_index_if_new(plan, number, step, generation)
        views = self._piece_views(plan, number)
        copy_done = None
        with torch.no_grad():
            if plan.devices:
                assert self._streams is not None
                self._streams.begin(plan.devices)
                by_device: dict[torch.device | None, list[int]] = {}
                for k, p in enumerate(placed):
                    src = plan.sources[p.index]
                    by_device.setdefault(src.device if src.is_cuda else None, []).append(k)
                for device, ks in by_device.items():
                    if device is None:
                        for k in ks:
                            _copy(views[k], plan.sources[placed[k].index], placed[k], plan, False)
                        continue
                    with self._streams.on(device) as stream:
                        for k in ks:
                            src = plan.sources[placed[k].index]
                            _copy(views[k], src, placed[k], plan, True)
                            src.record_stream(stream)
                copy_done = self._streams.finish()
            else:
                for view, p in zip(views, placed, strict=True):
                    _copy(view, plan.sources[p.index], p, plan, False)
        if copy_done is None:
            self._end_write(generation)
        spans = [
            StagedSpan(
                p.index,
                p.start,
                p.end,
                self._segments[p.segment].view[p.offset : p.offset + p.end - p.start],
            )
            for p in placed
        ]
        self.stats.stages += 1
        seconds = time.perf_counter() - t0
        return StagedPiece(self, number, len(layout.pieces), spans, placed, generation,
                           seconds, copy_done, step)

    def _piece_views(self, plan: StagePlan, number: int) -> list[torch.Tensor]:
        """Destination views of one piece: whole tensors shaped like their source,
        split spans as bytes. Cached with the layout (building views costs more than
        copying a small tensor)."""
        layout = plan.layout
        cache_key = (layout.ident, number)
        views = self._views.get(cache_key)
        if views is None:
            views = []
            for p in layout.pieces[number]:
                info = plan.infos[p.index]
                raw = self._segments[p.segment].tensor[p.offset : p.offset + p.end - p.start]
                if p.start == 0 and p.end == info.nbytes:
                    views.append(raw.view(info.dtype).view(info.shape))
                else:
                    views.append(raw)
            if len(self._views) > 64:
                self._views.clear()
            self._views[cache_key] = views
        return views

    # -- the index (staging/index.py writes it) --------------------------------------------

    def _write_index_if_new(
        self, plan: StagePlan, number: int, step: int | None, generation: int
    ) -> None:
        """Writes the layout of a piece before its copies (training thread) when it
        differs from what the index holds: a reader must not map new bytes with an
        old layout. A reused layout costs nothing here."""
        key = (plan.layout.ident, number)
        if self._index_key == key:
            return
        self._index_key = key
        doc = index_doc(self.job, self.rank, self._segments, plan.infos,
                        plan.layout.pieces[number], plan.chunk_size, state="staging",
                        step=step, generation=generation, piece=(number, plan.piece_count))
        write_index(self.directory, doc)

    def _publish(self, piece: StagedPiece, chunk_ids: Sequence[Sequence[str]]) -> None:
        """Records a hashed piece in the index (pipeline thread)."""
        # Under the lock: ``close`` must not remove the directory between the check
        # and the write (a late index would be left behind).
        with self._lock:
            layout = self._layout
            if layout is None or self._closed or self.generation != piece.generation:
                return  # overwritten or closed since: the index would lie
            infos: list[TensorInfo] = layout.key[1]
            doc = index_doc(self.job, self.rank, self._segments, infos, piece._placed,
                            layout.key[0], state="staged", step=piece.step,
                            generation=piece.generation, piece=(piece.number, piece.count))
            entries = tuple(dataclasses.replace(entry, chunks=tuple(ids))
                            for entry, ids in zip(doc.entries, chunk_ids, strict=True))
            write_index(self.directory, dataclasses.replace(doc, entries=entries))

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for copies in flight, unpins, unmaps and removes every file of the
        pool and its empty directories. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._sync_copies()
            for seg in self._segments:
                self._unpin(seg)
        except Exception as exc:  # a broken CUDA context must not keep the files
            log.warning("staging: releasing pinned memory failed: %s", exc)
        self._views = {}
        self._layout = None
        self._segments = []
        self._finalizer()  # _Resources.release: unlink, unmap, rmdir

    @classmethod
    def open_existing(
        cls, job: str, rank: int, root: str | os.PathLike[str] | None = None
    ) -> StagedPoolReader | None:
        """A read-only view of the pool ``job``/``rank`` left (or holds now), or None
        when it has no index. What it says is a hint: verify every chunk by hash."""
        return StagedPoolReader.open(pool_dir(job, rank, root))
