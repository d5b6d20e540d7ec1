"""The pool's files: its directory, the mapped segments, the control file (the
owner's lock and the seqlock generation), and their removal, also from a
finalizer or at exit, when the pool object is gone."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ckptd.errors import StagingError
from ckptd.knobs import shm_dir

from .format import CONTROL_MAGIC, CONTROL_NAME, CONTROL_SIZE, GEN_AT

log = logging.getLogger(__name__)


def _user_root(root: Path | None) -> Path:
    return (shm_dir() if root is None else Path(root)) / f"ckptd-{os.getuid()}"


def own_user_root(root: Path | None) -> Path:
    """This user's directory of pools under ``root`` (``/dev/shm`` by default, which
    anyone may write), made if missing, and checked before anything goes in it: a
    directory (not a link) of this user's, which no one else may enter (made so
    when it is not). Another user could else make it first and then read the
    staged state, or swap a rank's pool under it."""
    path = _user_root(root)
    for attempt in range(5):
        with contextlib.suppress(FileExistsError):
            path.mkdir(parents=True, mode=0o700)
        try:
            fd = open_own_directory(path)
            break
        except FileNotFoundError:
            # A clean removed it, empty, between the mkdir and the open: make it again.
            if attempt == 4:
                raise StagingError(f"cannot create the staging directory {path}") from None
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def open_own_directory(path: Path) -> int:
    """A descriptor of the directory ``path``, opened without following a link, so
    that what is checked is what is then changed; ``StagingError`` when it is a
    link, not a directory, or another user's (``OSError`` when it is not there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise _not_ours(path, "is not a directory (a link, or a file)") from None
    owner = os.fstat(fd).st_uid
    if owner != os.getuid():
        os.close(fd)
        raise _not_ours(path, f"belongs to uid {owner}, not to this user (uid {os.getuid()})")
    return fd


def _not_ours(path: Path, problem: str) -> StagingError:
    return StagingError(f"the staging directory {path} {problem}: someone else made it; "
                        "remove it, or stage elsewhere with CKPTD_SHM_DIR")


def pool_dir(job: str, rank: int, root: str | os.PathLike[str] | None = None) -> Path:
    """The directory of the staging pool of ``job``/``rank`` under ``root``."""
    return _user_root(None if root is None else Path(root)) / job / f"rank-{int(rank)}"


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


class _Segment:
    """One mapped segment of the pool."""

    __slots__ = ("file", "mm", "nbytes", "path", "pinned", "tensor", "view")

    def __init__(self, file: str, path: Path | None, mm: mmap.mmap, nbytes: int) -> None:
        self.file = file
        self.path = path  # None for an anonymous (memfd) segment
        self.mm = mm
        self.nbytes = nbytes
        self.view = memoryview(mm)
        # Through numpy, every tensor view holds a buffer export of the map, as the
        # memoryviews do: ``mm.close()`` then refuses while a view lives (an error's
        # traceback frames may keep one past ``close``), and the unmap waits for the
        # views to go. ``torch.frombuffer`` holds no export: its views would dangle.
        self.tensor = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
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
                        "(docker --shm-size; on Kubernetes an emptyDir of medium: Memory at "
                        "/dev/shm, docs/operations.md) or set CKPTD_SHM_DIR.", directory, nbytes,
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
        if os.fstat(fd).st_size < CONTROL_SIZE:
            os.ftruncate(fd, CONTROL_SIZE)
        mm = mmap.mmap(fd, CONTROL_SIZE, flags=mmap.MAP_SHARED)
        if mm[:8] != CONTROL_MAGIC:
            mm[:8] = CONTROL_MAGIC
        return fd, mm
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _read_generation(mm: mmap.mmap) -> int:
    return int(struct.unpack_from("<Q", mm, GEN_AT)[0])


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


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a user's own fork) holds copies of this
    process's pools, not pools of its own: neither its exit nor its garbage
    collector may remove them (a child ending normally removed the parent's
    staged snapshot)."""
    for res in _LIVE:
        res.done = True
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _release_at_exit() -> None:
    for res in list(_LIVE):
        try:
            res.release(at_exit=True)
        except Exception as exc:  # exiting: report, never raise
            log.warning("staging: cleanup of %s at exit failed: %s", res.directory, exc)
