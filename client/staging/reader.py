"""Reading a pool that this or a dead process staged (``StagedPoolReader``), and
removing the pools whose owners are gone."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ckptd.errors import InvalidDocument, StagingError, UnsupportedFormat
from ckptd.pages import libc_madvise

from .format import CONTROL_NAME, CONTROL_SIZE, INDEX_NAME, ControlHeader, PoolIndex, SpanRecord
from .segments import (
    _open_control,
    _read_generation,
    _remove_empty_dirs,
    _remove_pool_files,
    _user_root,
    open_own_directory,
)

log = logging.getLogger(__name__)


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
                if os.fstat(fd).st_size >= CONTROL_SIZE:
                    self._control = mmap.mmap(fd, CONTROL_SIZE, access=mmap.ACCESS_READ)
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

    def close(self, *, unmap_later: bool = False) -> None:
        """Unmaps the pool; ``unmap_later``: its segments on a thread of their own
        (unmapping a GiB of pages that were read takes 20-60 ms, which a restore
        need not wait for). A segment still viewed stays mapped until its last
        view goes."""
        maps, self._maps = list(self._maps.values()), {}
        if unmap_later and maps:
            threading.Thread(target=_unmap, args=(maps,), name="ckptd-unmap",
                             daemon=True).start()
        else:
            _unmap(maps)
        if self._control is not None:
            with contextlib.suppress(BufferError):
                self._control.close()
            self._control = None

    def __enter__(self) -> StagedPoolReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MADVISE = libc_madvise()
_DONTNEED = 4  # MADV_DONTNEED: a shared map's pages come back from the file if read


def _unmap(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        # CPython's mmap.close() holds the GIL while it unmaps (tens of ms per GiB
        # of pages read): their page tables go first, through ctypes, without it.
        if _MADVISE is not None and len(mm):
            with contextlib.suppress(BufferError, ValueError, TypeError):
                view = np.frombuffer(mm, dtype=np.uint8)
                address = view.ctypes.data
                del view  # (an export left would keep the map from closing)
                _MADVISE(ctypes.c_void_p(address), ctypes.c_size_t(len(mm)), _DONTNEED)
        with contextlib.suppress(BufferError):
            mm.close()


def _owner_pid(directory: Path) -> int | None:
    try:
        with open(directory / CONTROL_NAME, "rb") as f:
            head = f.read(CONTROL_SIZE)
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
    try:  # (missing, or another user's or a link: nothing of this user's is there)
        os.close(open_own_directory(base))
    except (StagingError, OSError):
        return []
    jobs = [base / job] if job is not None else sorted(base.iterdir())
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
    # Renamed away while its lock is held, then removed: a process that claims the
    # name from here on (it unlinks as we remove, and locks a control file of its
    # own) finds no directory and makes a new one, which this never touches.
    doomed = d.with_name(f"{d.name}.removing-{secrets.token_hex(4)}")
    try:
        try:
            d.rename(doomed)
        except OSError:
            return False  # gone already, or not ours to rename
        _remove_pool_files(doomed)
    finally:
        mm.close()
        os.close(fd)
    with contextlib.suppress(OSError):
        shutil.rmtree(doomed) if any(doomed.iterdir()) else doomed.rmdir()
    return True
