"""Staging: the host copy of a rank's tensors that a snapshot uploads from.

Problem
    ``save()`` may block the training loop only for one copy of the state
    (invariant 5), host memory must stay bounded at about one staged copy, and a
    worker that crashed must find its last staged snapshot on the node when it
    restarts (the restore tiers). Fresh memory costs ten times a copy into touched
    memory, so nothing may be allocated per save once warm.

Design
    *The pool.* One ``StagingPool`` per (job, rank) owns a directory
    ``<shm_dir>/ckptd-<uid>/<job>/rank-<rank>/`` (``shm_dir``: ``CKPTD_SHM_DIR``,
    default ``/dev/shm``; the uid keeps users of one node apart) holding:

    The control file and the index are an on-disk format, specified in
    docs/FORMAT.md ("Staging pool") and parsed into frozen values by
    ``staging_format`` (``ControlHeader``, ``PoolIndex``):

    ``control``
        64 bytes, mapped shared: magic ``CKPTDSP1``, a u64 *generation* at offset
        8, the owner's pid at 16. The owner holds an exclusive ``flock`` on it for
        its lifetime, so a second live process with the same job and rank (a test
        suite, a misconfigured launch) stages into a private sibling directory
        ``rank-<rank>.<pid>-<tag>`` instead of overwriting the first one's pool;
        the lock dies with the process, so a restarted worker gets the real name.
    ``seg-<tag>-<n>``
        Segments: files sized with ``posix_fallocate`` (on tmpfs that reserves the
        pages, so a full ``/dev/shm`` is an error here and never a SIGBUS later;
        when it is full the pool falls back to an anonymous ``memfd`` segment, which
        works but does not survive the process, with a warning), mapped
        ``MAP_SHARED | MAP_POPULATE`` and viewed as one uint8 tensor each
        (``torch.frombuffer``). Staged tensors are views at 64-byte (4 KiB from 64
        KiB up) aligned offsets. On CUDA every segment is pinned with
        ``cudaHostRegister`` (portable) once a state with CUDA tensors is staged.
    ``index.json``
        Written atomically (temporary name, rename): the step, the generation, the
        state (``"staging"`` while copies of a new layout run, ``"staged"`` once the
        pipeline hashed them, with the chunk ids), and for every staged span its
        tensor's name, dtype (the format's name), shape and size, the byte range
        ``[start, end)`` of the tensor it holds, its first chunk's number, the
        segment and the offset. The training thread writes it only when the layout
        changes (before the copies, so no reader maps new bytes with an old
        layout); the pipeline rewrites it, off the training thread, once a piece is
        hashed.

    *Seqlock.* The generation is bumped to odd before a stage overwrites the
    buffers and back to even once the copies are complete (on a GPU: when the
    pipeline has seen the copy-done event). A reader (the failover restore, a
    future peer chunk server) reads the generation, reads the bytes, reads the
    generation again: the bytes are the indexed snapshot only when both reads
    equal the index's (even) generation. Readers verify every chunk by its hash
    anyway; the index and the generation are hints, never trusted.

    *Layouts.* A layout places each tensor, keyed by (name, dtype, shape) in
    order, and is reused while that key holds: a warm save allocates nothing and
    copies straight into cached views. When the state changes (optimizer state
    that appears after the first step), tensors are packed first-fit-decreasing
    into the existing segments and the rest go into one new segment. Segments a
    smaller state leaves empty are kept (a state that alternates does not
    reallocate) while the pool stays within 1.5 times the largest state staged
    (or within the budget); past that, empty segments are dropped, and if that is
    not enough the pool is rebuilt as one segment that fits the state exactly.

    *Budget.* ``budget`` (bytes, None: the whole state) bounds the bytes mapped.
    A state that outgrows it is staged in *pieces*: the pool is one segment of
    ``budget`` bytes; tensors are laid out in order and split at chunk boundaries
    (multiples of ``chunk_size`` from the tensor's start, so chunk ids are those of
    a whole-state save); each piece is copied, handed to the pipeline, and
    overwritten by the next only once the pipeline has hashed and uploaded it. The
    stall grows; memory does not.

    *CUDA.* A stage records an event on each device's current stream, makes a
    dedicated side stream wait for it, and issues every copy there with
    ``non_blocking=True`` into the pinned views (sources get ``record_stream`` so a
    temporary the caller frees is not reused under the copy); a second event on
    the side stream marks the copies done. ``save()`` returns once they are
    enqueued; the pipeline's hashing thread waits on the done event before reading.
    On the CPU the copies are plain synchronous ``copy_`` calls.

    *Lifetime.* ``close()`` waits for the copies, unpins, unmaps, and removes the
    segments, the index, the control file and the empty directories. A pool that
    is garbage collected, or alive at a normal interpreter exit, is removed the
    same way (a finalizer and an ``atexit`` hook). A process killed by a signal,
    ``os._exit``, or an interpreter exit on an uncaught exception (other than
    ``KeyboardInterrupt``) leaves its pool: that is the crash the failover tier
    restores from. ``StagingPool.open_existing`` reads such a pool;
    ``remove_stale_pools`` removes pools whose owner is gone.

Alternatives
    Per-tensor ``torch.empty`` buffers (the previous staging): private memory that
    dies with the process. ``UntypedStorage._new_shared`` (DCP's stager): one
    anonymous segment per tensor, not named by job and rank, not budgeted.
    ``torch.from_file``: no control over reservation (SIGBUS on a full tmpfs).

Testing
    ``tests/integration/test_staging.py`` (reuse counted by ``PoolStats``, budget,
    cleanup, crash leftovers, concurrency with the seqlock),
    ``tests/integration/test_snapshot_policy.py`` (on_busy), and
    ``tests/gpu/test_cuda_staging.py`` (pinned, side-stream copies; needs CUDA).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import os
import secrets
import shutil
import struct
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckptd.errors import InvalidDocument, InvalidRequest, StagingError, UnsupportedFormat
from ckptd.knobs import shm_dir

from . import cuda
from .staging_format import (
    CONTROL_MAGIC,
    CONTROL_NAME,
    CONTROL_SIZE,
    GEN_AT,
    INDEX_NAME,
    PID_AT,
    POOL_VERSION,
    ControlHeader,
    PoolIndex,
    PoolState,
    SegmentRecord,
    SpanRecord,
)
from .state import dtype_name

log = logging.getLogger(__name__)

PAGE = 4096
SMALL_ALIGN = 64
PAGE_ALIGN_FROM = 64 * 1024  # tensors this large start on a page
SEGMENT_GRAIN = 2 * 1024 * 1024  # unbudgeted segments are rounded up to this
INDEX_VERSION = POOL_VERSION
_CONTROL_MAGIC = CONTROL_MAGIC
_CONTROL_SIZE = CONTROL_SIZE
_GEN_AT = GEN_AT
_PID_AT = PID_AT
_BOUNCE = 16 * 1024 * 1024  # bytes of a non-contiguous tensor gathered at once
_KEEP_FACTOR = 1.5  # rebuild the pool when it is this much larger than the state


def _user_root(root: Path | None) -> Path:
    return (shm_dir() if root is None else Path(root)) / f"ckptd-{os.getuid()}"


def pool_dir(job: str, rank: int, root: str | os.PathLike[str] | None = None) -> Path:
    """The directory of the staging pool of ``job``/``rank`` under ``root``."""
    return _user_root(None if root is None else Path(root)) / job / f"rank-{int(rank)}"


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _alignment(nbytes: int) -> int:
    return PAGE if nbytes >= PAGE_ALIGN_FROM else SMALL_ALIGN


def _footprint(nbytes: int) -> int:
    return _align(nbytes, _alignment(nbytes))


# -- values -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What the manifest needs of one tensor of a save."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class StagedSpan:
    """Bytes ``[start, end)`` of one tensor's C-order bytes, staged in the pool.

    ``start`` is a multiple of the chunk size, so the span's chunks are the
    tensor's chunks ``start // chunk_size`` onwards. ``data`` is a zero-copy view
    of the pool: valid until the next stage."""

    index: int  # into the save's tensor list
    start: int
    end: int
    data: memoryview


@dataclass(slots=True)
class PoolStats:
    """Counts of what the pool did, for tests and metrics."""

    segments_created: int = 0
    segments_removed: int = 0
    bytes_allocated: int = 0  # fresh memory mapped, over the pool's life
    bytes_mapped: int = 0  # mapped now
    peak_bytes_mapped: int = 0
    fallback_segments: int = 0  # anonymous memfd segments (shm_dir was full)
    layouts: int = 0  # layouts built (a reused layout does not count)
    stages: int = 0  # pieces staged


# -- segments ---------------------------------------------------------------------------


class _Segment:
    """One mapped segment of the pool."""

    __slots__ = ("file", "mm", "nbytes", "path", "pinned", "tensor", "view")

    def __init__(self, file: str, path: Path | None, mm: mmap.mmap, nbytes: int) -> None:
        self.file = file
        self.path = path  # None for an anonymous (memfd) segment
        self.mm = mm
        self.nbytes = nbytes
        self.view = memoryview(mm)
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self.pinned = False

    def release(self) -> None:
        """Drops the views and unmaps (left to the GC when a view is still held
        elsewhere, e.g. by a pipeline thread that outlived ``close``)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):
            self.view.release()
        try:
            self.mm.close()
        except BufferError:
            log.debug("staging: segment %s still viewed; unmapped when the views go", self.file)


def _map(fd: int, nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _create_segment(directory: Path, file: str, nbytes: int, stats: PoolStats) -> _Segment:
    path = directory / file
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            os.close(fd)
            fd = -1
            path.unlink(missing_ok=True)
            log.warning("staging: %s has no room for %d bytes (%s); staging into private "
                        "memory, which a restarted worker cannot restore from. Make it larger "
                        "(docker --shm-size) or set CKPTD_SHM_DIR.", directory, nbytes,
                        os.strerror(exc.errno or 0))
            return _create_anonymous(file, nbytes, stats)
        seg = _Segment(file, path, _map(fd, nbytes), nbytes)
    except BaseException:
        if fd >= 0:
            path.unlink(missing_ok=True)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    return seg


def _create_anonymous(file: str, nbytes: int, stats: PoolStats) -> _Segment:
    fd = os.memfd_create(f"ckptd-{file}", os.MFD_CLOEXEC)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise StagingError(
                f"cannot reserve {nbytes} bytes of staging memory: {os.strerror(exc.errno or 0)}",
                nbytes=nbytes,
            ) from None
        stats.fallback_segments += 1
        return _Segment(file, None, _map(fd, nbytes), nbytes)
    finally:
        os.close(fd)


# -- the control file (ownership lock and seqlock generation) ---------------------------


def _open_control(directory: Path, *, lock: bool) -> tuple[int, mmap.mmap] | None:
    """Opens (creating it if absent) and maps a pool's control file; with ``lock``,
    takes its exclusive flock or returns None when a live process holds it."""
    path = directory / CONTROL_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if lock:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            # The previous owner may have unlinked the file between our open and our
            # lock: a lock on an unlinked inode guards nothing.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                return _open_control(directory, lock=lock)
        if os.fstat(fd).st_size < _CONTROL_SIZE:
            os.ftruncate(fd, _CONTROL_SIZE)
        mm = mmap.mmap(fd, _CONTROL_SIZE, flags=mmap.MAP_SHARED)
        if mm[:8] != _CONTROL_MAGIC:
            mm[:8] = _CONTROL_MAGIC
        return fd, mm
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _read_generation(mm: mmap.mmap) -> int:
    return int(struct.unpack_from("<Q", mm, _GEN_AT)[0])


# -- cleanup that must run without the pool object (finalizer, atexit) -----------------


class _Resources:
    """What removing a pool takes, kept apart from the pool so a finalizer can
    run it after the pool is gone."""

    def __init__(self, directory: Path, fd: int, control: mmap.mmap) -> None:
        self.directory = directory
        self.fd = fd
        self.control: mmap.mmap | None = control
        self.segments: list[_Segment] = []
        self.done = False
        self.lock = threading.Lock()

    def release(self, at_exit: bool = False) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        _LIVE.discard(self)
        exc = getattr(sys, "last_value", None)
        # An interactive session keeps its last error around: not a crash.
        interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
        keep = (at_exit and exc is not None and not isinstance(exc, KeyboardInterrupt)
                and not interactive)
        if keep:
            # Dying on an error: the staged snapshot is what a restarted worker
            # restores from. Leave it (and drop the lock with the process).
            log.info("staging: exiting on %s; leaving %s for a restart",
                     type(exc).__name__, self.directory)
            return
        for seg in self.segments:
            if seg.path is not None:
                seg.path.unlink(missing_ok=True)
            if not at_exit:
                seg.release()
        self.segments = []
        _remove_pool_files(self.directory)
        if self.control is not None and not at_exit:
            with contextlib.suppress(BufferError):
                self.control.close()
        self.control = None
        with contextlib.suppress(OSError):
            os.close(self.fd)
        _remove_empty_dirs(self.directory)


def _remove_pool_files(directory: Path) -> None:
    """Removes every file of a pool directory (segments, index, temporaries, and the
    control file last: its lock is the pool's ownership)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in sorted(names, key=lambda n: n == CONTROL_NAME):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (directory / name).unlink()


def _remove_empty_dirs(directory: Path) -> None:
    """Removes ``directory`` and its parents up to the ``ckptd-<uid>`` root while
    they are empty."""
    d = directory
    for _ in range(3):  # rank-N, the job, ckptd-<uid>
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


_LIVE: set[_Resources] = set()


@atexit.register
def _release_at_exit() -> None:
    for res in list(_LIVE):
        try:
            res.release(at_exit=True)
        except Exception as exc:  # exiting: report, never raise
            log.warning("staging: cleanup of %s at exit failed: %s", res.directory, exc)


# -- layouts ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Placed:
    """One span's place in the pool."""

    index: int
    start: int
    end: int
    segment: int
    offset: int


@dataclass(slots=True)
class _Layout:
    key: tuple[int, list[TensorInfo]]  # (chunk size, the tensors it places)
    pieces: list[list[_Placed]]
    ident: int = field(default_factory=lambda: secrets.randbits(48))  # names its caches


@dataclass(slots=True)
class StagePlan:
    """What one save stages: its tensors and the layout of each piece."""

    infos: list[TensorInfo]
    sources: list[torch.Tensor]
    layout: _Layout
    chunk_size: int
    devices: list[torch.device]  # CUDA devices among the sources

    @property
    def piece_count(self) -> int:
        return len(self.layout.pieces)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos)


class StagedPiece:
    """One staged piece of a save (the whole state unless a budget split it).

    ``wait_copied`` blocks until the copies are complete (at once on the CPU; on a
    GPU it waits for the copy-done event and closes the seqlock write); ``publish``
    records the spans' chunk ids in the pool's index. Both are called by the
    pipeline, off the training thread."""

    def __init__(
        self,
        pool: StagingPool,
        number: int,
        count: int,
        spans: list[StagedSpan],
        placed: list[_Placed],
        generation: int,
        seconds: float,
        copy_done: cuda.CopyDone | None,
        step: int | None,
    ) -> None:
        self._pool = pool
        self.number = number
        self.count = count
        self.spans = spans
        self._placed = placed
        self.generation = generation
        self.seconds = seconds
        self.copy_done = copy_done
        self.step = step
        self.copied = copy_done is None

    @property
    def last(self) -> bool:
        return self.number == self.count - 1

    @property
    def nbytes(self) -> int:
        return sum(s.end - s.start for s in self.spans)

    def wait_copied(self) -> None:
        if self.copied:
            return
        assert self.copy_done is not None
        self.copy_done.synchronize()
        self._pool._end_write(self.generation)
        self.copied = True

    def publish(self, chunk_ids: Sequence[Sequence[str]]) -> None:
        self._pool._publish(self, chunk_ids)


# -- the pool ---------------------------------------------------------------------------


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
        struct.pack_into("<Q", control, _PID_AT, os.getpid())

    def _claim(self) -> tuple[Path, int, mmap.mmap]:
        primary = pool_dir(self.job, self.rank, self.root)
        candidates = [primary] + [
            primary.with_name(f"{primary.name}.{os.getpid()}-{secrets.token_hex(3)}")
            for _ in range(3)
        ]
        for i, directory in enumerate(candidates):
            for _ in range(5):  # a closing owner may remove the directory under us
                try:
                    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                    opened = _open_control(directory, lock=True)
                    break
                except FileNotFoundError:
                    continue
            else:
                raise StagingError(f"cannot create the staging directory {directory}")
            if opened is not None:
                if i:
                    log.warning("staging: %s is in use by another live process (pid %s); "
                                "staging into %s, which a restart will not find", primary,
                                _owner_pid(primary), directory.name)
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
            struct.pack_into("<Q", self._control, _GEN_AT, g)
            return g + 1  # the generation the buffers will have once the copies are done

    def _end_write(self, generation: int) -> None:
        with self._lock:
            if self.generation == generation - 1:
                struct.pack_into("<Q", self._control, _GEN_AT, generation)

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
            infos.append(TensorInfo(name, t.dtype, tuple(t.shape), t.numel() * t.element_size()))
            sources.append(t)
            if t.device.type == "cuda":
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
            cuda.unpin(seg.tensor.data_ptr())
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

    # -- the index ----------------------------------------------------------------------

    def _entries(self, plan_infos: Sequence[TensorInfo], placed: Sequence[_Placed],
                 chunk_size: int) -> tuple[SpanRecord, ...]:
        return tuple(
            SpanRecord(
                name=plan_infos[p.index].name,
                dtype=dtype_name(plan_infos[p.index].dtype),
                shape=tuple(plan_infos[p.index].shape),
                nbytes=plan_infos[p.index].nbytes,
                start=p.start,
                end=p.end,
                first_chunk=p.start // chunk_size,
                segment=self._segments[p.segment].file,
                offset=p.offset,
            )
            for p in placed
        )

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
        doc = self._index_doc(plan.infos, plan.layout.pieces[number], plan.chunk_size,
                              state="staging", step=step, generation=generation,
                              piece=(number, plan.piece_count))
        self._write_index(doc)

    def _index_doc(self, infos: Sequence[TensorInfo], placed: Sequence[_Placed],
                   chunk_size: int, *, state: PoolState, step: int | None, generation: int,
                   piece: tuple[int, int]) -> PoolIndex:
        return PoolIndex(
            job=self.job,
            rank=self.rank,
            pid=os.getpid(),
            state=state,
            step=step,
            generation=generation,
            chunk_size=chunk_size,
            piece=piece,
            segments=tuple(SegmentRecord(s.file, s.nbytes, s.path is not None)
                           for s in self._segments),
            entries=self._entries(infos, placed, chunk_size),
        )

    def _publish(self, piece: StagedPiece, chunk_ids: Sequence[Sequence[str]]) -> None:
        """Records a hashed piece in the index (pipeline thread)."""
        # Under the lock: ``close`` must not remove the directory between the check
        # and the write (a late index would be left behind).
        with self._lock:
            layout = self._layout
            if layout is None or self._closed or self.generation != piece.generation:
                return  # overwritten or closed since: the index would lie
            infos: list[TensorInfo] = layout.key[1]
            doc = self._index_doc(infos, piece._placed, layout.key[0], state="staged",
                                  step=piece.step, generation=piece.generation,
                                  piece=(piece.number, piece.count))
            entries = tuple(dataclasses.replace(entry, chunks=tuple(ids))
                            for entry, ids in zip(doc.entries, chunk_ids, strict=True))
            self._write_index(dataclasses.replace(doc, entries=entries))

    def _write_index(self, doc: PoolIndex) -> None:
        path = self.directory / INDEX_NAME
        tmp = self.directory / f"{INDEX_NAME}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(doc.encode())
            os.replace(tmp, path)
        except OSError as exc:  # the index is a hint: losing it only slows a restart
            log.warning("staging: cannot write %s: %s", path, exc)

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


def _pack_sequential(
    order: Sequence[int], infos: Sequence[TensorInfo], seg: _Segment, segments: list[_Segment]
) -> list[_Placed]:
    out = []
    cursor = 0
    index = segments.index(seg)
    for i in order:
        n = infos[i].nbytes
        off = _align(cursor, _alignment(n))
        out.append(_Placed(i, 0, n, index, off))
        cursor = off + n
    assert cursor <= seg.nbytes, "segment too small for its tensors"
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, p: _Placed, plan: StagePlan,
          non_blocking: bool) -> None:
    src = src.detach()
    if p.start == 0 and p.end == plan.infos[p.index].nbytes:
        dst.copy_(src, non_blocking=non_blocking)
    else:
        _copy_bytes(dst, src, p.start, p.end, non_blocking)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, a: int, b: int, non_blocking: bool) -> None:
    """``dst`` (uint8) = bytes ``[a, b)`` of ``src`` in C order, for any strides.

    A split may fall inside a row or an element (chunk sizes need not be multiples
    of either): contiguous sources are sliced as bytes; others are gathered a
    block of rows at a time (at most ``_BOUNCE`` bytes), recursing into a row that
    alone is larger."""
    if b <= a:
        return
    if src.is_contiguous():
        dst.copy_(src.reshape(-1).view(torch.uint8)[a:b], non_blocking=non_blocking)
        return
    row = (src[0].numel() if src.shape[0] else 0) * src.element_size()
    pos = a
    while pos < b:
        r = pos // row
        if row > _BOUNCE:
            hi = min(b, (r + 1) * row)
            _copy_bytes(dst[pos - a : hi - a], src[r], pos - r * row, hi - r * row, non_blocking)
        else:
            r2 = min(src.shape[0], r + max(1, _BOUNCE // row), math.ceil(b / row))
            block = src[r:r2].contiguous()
            hi = min(b, r2 * row)
            flat = block.reshape(-1).view(torch.uint8)
            dst[pos - a : hi - a].copy_(flat[pos - r * row : hi - r * row],
                                        non_blocking=non_blocking)
        pos = hi


# -- readers ----------------------------------------------------------------------------


class StagedPoolReader:
    """A read-only view of a staging pool, live or left by a dead process.

    ``index`` is the pool's ``index.json``; ``spans()`` yields each staged span's
    record and bytes, ``chunks()`` each chunk the index names with its bytes. Check
    ``consistent()`` after reading (seqlock) and verify every chunk by its hash:
    a half-overwritten pool still gives its unchanged chunks."""

    def __init__(self, directory: Path, index: PoolIndex) -> None:
        self.directory = directory
        self.index = index
        self._maps: dict[str, mmap.mmap] = {}
        self._control: mmap.mmap | None = None
        try:
            fd = os.open(directory / CONTROL_NAME, os.O_RDONLY)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                if os.fstat(fd).st_size >= _CONTROL_SIZE:
                    self._control = mmap.mmap(fd, _CONTROL_SIZE, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        if self._control is not None:
            try:  # another version's control file: refused like its index
                ControlHeader.unpack(self._control[:], str(directory / CONTROL_NAME))
            except InvalidDocument:
                self.close()
                raise

    @classmethod
    def open(cls, directory: Path) -> StagedPoolReader | None:
        """The pool in ``directory``, or None when it has no readable index;
        ``UnsupportedFormat`` when it is a pool of another version."""
        path = directory / INDEX_NAME
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            log.warning("staging: unreadable index in %s: %s", directory, exc)
            return None
        try:
            index = PoolIndex.parse(data, str(path))
        except UnsupportedFormat:
            raise
        except InvalidDocument as exc:  # torn or foreign: a hint we do not have
            log.warning("staging: %s", exc)
            return None
        return cls(directory, index)

    @property
    def step(self) -> int | None:
        return self.index.step

    @property
    def state(self) -> str:
        return self.index.state

    def generation(self) -> int | None:
        """The pool's generation now (odd: being overwritten); None without one."""
        return None if self._control is None else _read_generation(self._control)

    def consistent(self) -> bool:
        """True when the buffers hold exactly what the index says (read it again
        after reading the bytes)."""
        g = self.generation()
        return (self.state == "staged" and g is not None and g % 2 == 0
                and g == self.index.generation)

    def _segment(self, file: str) -> mmap.mmap | None:
        mm = self._maps.get(file)
        if mm is None:
            if "/" in file or file.startswith("."):
                return None
            try:
                fd = os.open(self.directory / file, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # empty or unmappable: no bytes to offer
                return None
            finally:
                os.close(fd)
            self._maps[file] = mm
        return mm

    def spans(self) -> Iterator[tuple[SpanRecord, memoryview]]:
        """Each index entry whose segment is still there, with its bytes."""
        for entry in self.index.entries:
            mm = self._segment(entry.segment)
            if mm is None:
                continue
            off, n = entry.offset, entry.end - entry.start
            if off + n > len(mm):
                continue
            yield entry, memoryview(mm)[off : off + n]

    def chunks(self) -> Iterator[tuple[str, int, str, memoryview]]:
        """(tensor name, chunk number, claimed chunk id, bytes) for every chunk the
        index names; unverified."""
        size = self.index.chunk_size
        for entry, data in self.spans():
            if not entry.chunks or size <= 0:
                continue
            for k, cid in enumerate(entry.chunks):
                yield entry.name, entry.first_chunk + k, cid, data[k * size : (k + 1) * size]

    def close(self) -> None:
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps = {}
        if self._control is not None:
            with contextlib.suppress(BufferError):
                self._control.close()
            self._control = None

    def __enter__(self) -> StagedPoolReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _owner_pid(directory: Path) -> int | None:
    try:
        with open(directory / CONTROL_NAME, "rb") as f:
            head = f.read(_CONTROL_SIZE)
    except OSError:
        return None
    try:
        return ControlHeader.unpack(head).pid or None
    except InvalidDocument:
        return None


def remove_stale_pools(
    root: str | os.PathLike[str] | None = None, job: str | None = None
) -> list[Path]:
    """Removes the pools under ``root`` (one job's, or all of this user's) whose
    owner is gone; returns their directories. Pools of live processes are kept."""
    base = _user_root(None if root is None else Path(root))
    jobs = [base / job] if job is not None else (sorted(base.iterdir()) if base.is_dir() else [])
    removed = []
    for job_dir in jobs:
        if not job_dir.is_dir():
            continue
        for d in sorted(job_dir.iterdir()):
            if d.is_dir() and d.name.startswith("rank-") and _remove_if_stale(d):
                removed.append(d)
        _remove_empty_dirs(job_dir)
    return removed


def _remove_if_stale(d: Path) -> bool:
    """Removes the pool directory ``d`` if no live process owns it."""
    try:
        opened = _open_control(d, lock=True)
    except OSError:
        return False
    if opened is None:
        return False  # a live owner
    fd, mm = opened
    try:
        _remove_pool_files(d)
    finally:
        mm.close()
        os.close(fd)
    with contextlib.suppress(OSError):
        shutil.rmtree(d) if any(d.iterdir()) else d.rmdir()
    return True


__all__ = [
    "ControlHeader",
    "PoolIndex",
    "PoolStats",
    "SegmentRecord",
    "SpanRecord",
    "StagePlan",
    "StagedPiece",
    "StagedPoolReader",
    "StagedSpan",
    "StagingError",
    "StagingPool",
    "TensorInfo",
    "pool_dir",
    "remove_stale_pools",
    "shm_dir",
]
