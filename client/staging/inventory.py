"""What staging pools this host holds (``ckptd shm``): each pool's job, rank, memory,
owner and the step it holds, and the removal of the pools whose owners are gone.

A pool is alive while a process holds the ``flock`` of its control file (the
format's rule; docs/FORMAT.md, "Staging pool"). That lock is asked for, never
kept: a shared, non-blocking probe that is released at once, so it works across
PID namespaces (an init container sees the lock of a training container's process
through the shared ``/dev/shm``, not its pid) and a process claiming the pool at
that moment retries its claim (``StagingPool._claim``). Removal goes through
``reader._remove_if_stale``: the pool is renamed away under the dead owner's lock,
so a process that claims the name meanwhile keeps its new pool.

Listing reads files only (no ``O_CREAT``, no write), so it can run as another user
or against a read-only mount.

Root runs this over every user's pools, in directories those users write (an init
container, a node's epilog): so no file is opened through a link or when it is
not a regular file (a FIFO would block the listing for good), nothing is opened
for writing, and a removal works on the directories it opened and locked, never
on a path looked up again (a user who swaps a pool for a link to ``/etc`` between
the lock and the unlinks has it unlink nothing but that user's own files)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError
from ckptd.knobs import shm_dir

from .format import CONTROL_NAME, CONTROL_SIZE, INDEX_NAME, ControlHeader, PoolIndex

_USER_ROOT = re.compile(r"ckptd-(\d+)")
# rank-<rank>, a live process's private sibling rank-<rank>.<pid>-<hex>, or one a
# removal renamed away (rank-<rank>....removing-<hex>) and did not finish.
_POOL_DIR = re.compile(r"rank-(\d+)(\..*)?")


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """One staging pool on this host, as ``ckptd shm`` shows it."""

    directory: Path
    uid: int  # the user whose pools these are (ckptd-<uid>)
    job: str
    rank: int
    nbytes: int  # memory its files hold
    pid: int | None  # the owner's pid, in the owner's PID namespace (None: unknown)
    alive: bool  # a process holds its lock
    step: int | None  # the step its index names
    state: str | None  # the index's state ("staged", "staging"); None: no readable index
    restorable: bool  # its bytes are the indexed step (a restart can restore from it)
    modified: float  # newest change of its index or directory (seconds since the epoch)
    note: str = ""  # a private sibling, a removal left half done, an unreadable pool

    def to_json(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "uid": self.uid, "job": self.job,
                "rank": self.rank, "bytes": self.nbytes, "pid": self.pid,
                "alive": self.alive, "step": self.step, "state": self.state,
                "restorable": self.restorable, "modified": self.modified, "note": self.note}


# Never through a link, never blocked by a FIFO, never kept across an exec.
_SAFE_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# An index larger than this is not read (a pool's index is kilobytes to a few MiB).
_INDEX_MAX = 256 << 20


def _open_regular(name: str | Path, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``name``; ``OSError`` when it is
    absent, a link, a FIFO, a device or a directory."""
    fd = os.open(name, _SAFE_OPEN, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_regular(path: Path, limit: int) -> bytes:
    fd = _open_regular(path)
    try:
        if os.fstat(fd).st_size > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _owner_alive(directory: Path) -> bool | None:
    """True when a process holds the pool's lock (or it cannot be asked: taken as
    alive, so never removed), False when none does, None when the pool has no
    control file (a pool being created, or being removed)."""
    try:
        fd = _open_regular(directory / CONTROL_NAME)
    except FileNotFoundError:
        return None
    except OSError:  # not ours to read, or not a file: nothing to say it is dead
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _read_control(directory: Path) -> ControlHeader | None:
    try:
        return ControlHeader.unpack(_read_regular(directory / CONTROL_NAME, CONTROL_SIZE))
    except (OSError, CkptdError):
        return None


def _read_index(directory: Path) -> PoolIndex | None:
    path = directory / INDEX_NAME
    try:
        return PoolIndex.parse(_read_regular(path, _INDEX_MAX), str(path))
    except (OSError, CkptdError):
        return None


def _usage(directory: Path) -> tuple[int, float]:
    """(bytes of memory the pool's files hold, newest mtime of its index or itself)."""
    used = 0
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = directory.stat().st_mtime
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                used += st.st_blocks * 512
                if entry.name == INDEX_NAME:
                    newest = max(newest, st.st_mtime)
    return used, newest


def _describe(directory: Path, uid: int, job: str, rank: int, suffix: str) -> PoolInfo:
    alive = _owner_alive(directory)
    control = _read_control(directory)
    index = _read_index(directory)
    nbytes, modified = _usage(directory)
    restorable = (index is not None and control is not None and index.state == "staged"
                  and control.generation % 2 == 0 and control.generation == index.generation)
    note = ""
    if ".removing-" in suffix:
        note = "being removed"
    elif suffix:
        note = "private sibling (another live process held the rank's pool)"
    if alive is None:
        note = note or "no control file (being created or removed)"
    return PoolInfo(
        directory=directory, uid=uid, job=job, rank=rank, nbytes=nbytes,
        pid=(control.pid or None) if control is not None else None, alive=bool(alive),
        step=index.step if index is not None else None,
        state=index.state if index is not None else None,
        restorable=restorable, modified=modified, note=note,
    )


def _user_roots(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[int, str]]]:
    """The ``ckptd-<uid>`` directories under ``root`` that user owns, and a line for
    each entry of that name a rank of the user refuses to stage in (a link, a file,
    a directory another user made first: ``segments.own_user_root``)."""
    roots: list[tuple[int, Path]] = []
    refused: list[tuple[int, str]] = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            m = _USER_ROOT.fullmatch(entry.name)
            if m is None:
                continue
            uid = int(m.group(1))
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                roots.append((uid, Path(entry.path)))
            elif stat.S_ISLNK(st.st_mode):
                refused.append((uid, f"{entry.path} is a symbolic link (to {_link(entry.path)})"))
            elif not stat.S_ISDIR(st.st_mode):
                refused.append((uid, f"{entry.path} is not a directory"))
            else:
                refused.append((uid, f"{entry.path} belongs to uid {st.st_uid}, not to uid {uid}"))
    return sorted(roots), sorted(refused)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def refused_user_roots(root: str | os.PathLike[str] | None = None, *,
                       all_users: bool = True) -> list[str]:
    """What ``list_pools`` passes over under ``root``: each ``ckptd-<uid>`` entry a
    rank of that uid refuses to stage in, said in a line (of this user's only, when
    not ``all_users``). Its ranks stage nowhere until it is removed."""
    _, refused = _user_roots(shm_dir() if root is None else Path(root))
    return [line for uid, line in refused if all_users or uid == os.getuid()]


def list_pools(root: str | os.PathLike[str] | None = None, *, job: str | None = None,
               all_users: bool = True) -> tuple[list[PoolInfo], list[str]]:
    """Every staging pool under ``root`` (``CKPTD_SHM_DIR`` or ``/dev/shm``): of every
    user, or only of this one. Returns the pools and what could not be read (another
    user's pools, without the right to read them)."""
    base = shm_dir() if root is None else Path(root)
    pools: list[PoolInfo] = []
    unreadable: list[str] = []
    me = os.getuid()
    for uid, user_root in _user_roots(base)[0]:
        if not all_users and uid != me:
            continue
        try:
            jobs = sorted(p for p in user_root.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError as exc:
            unreadable.append(f"{user_root}: {os.strerror(exc.errno or errno.EACCES)}")
            continue
        for job_dir in jobs:
            if job is not None and job_dir.name != job:
                continue
            try:
                names = sorted(os.listdir(job_dir))
            except OSError as exc:
                unreadable.append(f"{job_dir}: {os.strerror(exc.errno or errno.EACCES)}")
                continue
            for name in names:
                m = _POOL_DIR.fullmatch(name)
                d = job_dir / name
                if m is None or d.is_symlink() or not d.is_dir():
                    continue
                if not os.access(d, os.R_OK | os.X_OK):
                    unreadable.append(f"{d}: {os.strerror(errno.EACCES)}")
                    continue
                pools.append(_describe(d, uid, job_dir.name, int(m.group(1)), m.group(2) or ""))
    return pools, unreadable


def remove_dead_pools(
    root: str | os.PathLike[str] | None = None, *, job: str | None = None,
    older_than: float | None = None, all_users: bool = True,
) -> tuple[list[PoolInfo], list[PoolInfo]]:
    """Removes the pools under ``root`` whose owner is gone (of one job; last changed
    more than ``older_than`` seconds ago). A pool that a process claims meanwhile is
    kept. Returns (removed, kept: dead pools this could not remove, or that a process
    claimed meanwhile)."""
    pools, _ = list_pools(root, job=job, all_users=all_users)
    now = time.time()
    removed: list[PoolInfo] = []
    kept: list[PoolInfo] = []
    for pool in pools:
        if pool.alive:
            continue
        if older_than is not None and now - pool.modified < older_than:
            continue
        # The listing's answer is old by now: the removal asks the lock again, and
        # renames the pool away only while it holds it.
        try:
            gone = _remove_dead(pool.directory)
        except OSError:
            gone = False
        if gone:
            removed.append(pool)
            for empty in (pool.directory.parent, pool.directory.parent.parent):
                with contextlib.suppress(OSError):  # the job's, then the user's, if empty
                    empty.rmdir()
        elif pool.directory.exists():
            kept.append(pool)
    return removed, kept


def _remove_dead(directory: Path) -> bool:
    """Removes the pool at ``directory`` if no process holds its lock: renamed away
    and emptied (the control file last) while this holds the lock. Works on the
    descriptors of the job's and the pool's directories (see the module)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
    parent = os.open(directory.parent, flags)
    try:
        try:
            pool = os.open(directory.name, flags, dir_fd=parent)
        except OSError:  # gone, or not a directory now (a link)
            return False
        try:
            doomed = _remove_locked(parent, pool, directory.name)
        finally:
            os.close(pool)
        if doomed is None:
            return False
        with contextlib.suppress(OSError):
            os.rmdir(doomed, dir_fd=parent)
        with contextlib.suppress(OSError):  # what else was in it (fd-based: no link followed)
            shutil.rmtree(doomed, dir_fd=parent)
        return True
    finally:
        os.close(parent)


def _remove_locked(parent: int, pool: int, name: str) -> str | None:
    """Under the lock of its control file, renames the pool (``pool``, at ``name`` in
    ``parent``) away and unlinks its files; its new name, or None when a process
    holds the lock, or what is at ``name`` is not the directory opened as ``pool``."""
    try:
        control = _open_regular(CONTROL_NAME, dir_fd=pool)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(control, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # a live owner (or one claiming it now)
        try:  # an owner that closed may have replaced the file between open and lock
            same = os.stat(CONTROL_NAME, dir_fd=pool, follow_symlinks=False).st_ino == (
                os.fstat(control).st_ino)
        except OSError:
            same = False
        if not same:
            return None
        # Renamed while locked: a process that claims the name from here on makes a
        # new directory, which this never touches.
        doomed = f"{name}.removing-{secrets.token_hex(4)}"
        try:
            os.rename(name, doomed, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError:
            return None
        moved = os.stat(doomed, dir_fd=parent, follow_symlinks=False)
        opened = os.fstat(pool)
        if (moved.st_dev, moved.st_ino) != (opened.st_dev, opened.st_ino):
            return None  # swapped in between: what was renamed is not what was locked
        for entry in sorted(os.listdir(pool), key=lambda n: n == CONTROL_NAME):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                os.unlink(entry, dir_fd=pool)
        return doomed
    finally:
        os.close(control)


__all__ = ["PoolInfo", "list_pools", "refused_user_roots", "remove_dead_pools"]
