"""A store in a local (or shared) directory.

Writes go to a temporary name, are fsync'd, and then appear atomically: objects by
``link`` (which fails if the name exists, so create-if-absent holds across
processes), refs by ``rename`` under an ``flock``. The directory is fsync'd after
each, so a crash leaves either the old state or the new one, plus temporaries that
``list_prefix`` ignores. Objects of 1 MiB and more from page-aligned buffers are
written around the page cache (``direct_io``): they are fsync'd at once anyway."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import stat
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ckptd.errors import NotFound, StoreCorrupt, StoreError, StoreFull
from ckptd.pages import DAMAGED_ERRNOS
from ckptd.store import direct_io
from ckptd.store.base import ObjectInfo, Store, check_key, check_prefix

_TMP = ".tmp-"
_LOCKS = ".locks"
_CLAIM = "/removing.json"  # a step's removal claim (``ckptd.keys.removal_key``)


def _reason(exc: OSError) -> str:
    # The OS message names the absolute temp path; callers see only the key.
    return exc.strerror or type(exc).__name__


# A full disk or an exhausted quota: retrying will not help until space is freed.
_FULL = {errno.ENOSPC, errno.EDQUOT}


def _read_failed(key: str, exc: OSError) -> StoreError:
    """The typed error for a failed read of ``key``: ``StoreCorrupt`` naming it when
    the object is damaged, else ``StoreError`` (permissions, no file handles left)."""
    cls = StoreCorrupt if exc.errno in DAMAGED_ERRNOS else StoreError
    return cls(f"cannot read {key}: {_reason(exc)}", key=key)


def _is_object(entry: os.DirEntry[str]) -> bool:
    """A file, or an entry that does not resolve to anything (a link that loops), as
    ``os.walk`` lists it: an object whose reader gets ``StoreCorrupt``."""
    try:
        return entry.is_file()
    except OSError as exc:
        return exc.errno in DAMAGED_ERRNOS


def _write_failed(key: str, exc: OSError, verb: str = "write") -> StoreError:
    """The typed error for a failed write of ``key``: ``StoreFull`` when out of space."""
    cls = StoreFull if exc.errno in _FULL else StoreError
    return cls(f"cannot {verb} {key}: {_reason(exc)}", key=key)


# Content puts (chunks: hashed, written and fsync'd, milliseconds each) run on
# threads of their own, so a server's reads and writes of documents (manifests,
# commit records, refs, listings) never queue behind an upload's chunks on the
# default pool: under a full ingest on 2 cores a listing waited 20 ms (median)
# there, 7 - 9 ms beside it (bench/RESULTS.md). As many threads as that pool.
_CONTENT_WRITERS: ThreadPoolExecutor | None = None
_CONTENT_WRITERS_LOCK = threading.Lock()


def content_writers() -> ThreadPoolExecutor:
    """The threads every local store of this process writes content on."""
    global _CONTENT_WRITERS
    with _CONTENT_WRITERS_LOCK:
        if _CONTENT_WRITERS is None:
            _CONTENT_WRITERS = ThreadPoolExecutor(
                max_workers=min(32, (os.cpu_count() or 1) + 4),
                thread_name_prefix="ckptd-content-put")
        return _CONTENT_WRITERS


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True,
                 create: bool = True) -> None:
        """A store in ``root``, created when it is not there; ``create=False`` (who
        only reads: an export, a diff, a load) raises ``NotFound`` naming ``root``
        instead: a mistyped path is not a new, empty store."""
        self.root = Path(root).resolve()
        self.fsync = fsync
        if not create and not self.root.is_dir():
            what = "a file" if self.root.exists() else "no such directory"
            raise NotFound(f"no store at {self.root} ({what}); check the URL (reading "
                           "never creates a store)", path=str(self.root))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    # -- reads ----------------------------------------------------------------------

    def _get(self, key: str) -> bytes:
        # Opened without blocking: a FIFO put at an object's path (by hand, or by a
        # tool) would otherwise hang its reader (verify, scrub, a restore) for good.
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"no object at {key}", key=key) from None
        except OSError as exc:
            raise _read_failed(key, exc) from exc
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                with open(fd, "rb", closefd=False) as f:
                    return f.read()
        except OSError as exc:
            raise _read_failed(key, exc) from exc
        finally:
            os.close(fd)
        if stat.S_ISDIR(mode):  # a key above objects is no object (the store contract)
            raise NotFound(f"no object at {key}", key=key)
        raise StoreCorrupt(f"cannot read {key}: not a file", key=key)

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._get, key)

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self._path(key).is_file)

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        # Paths are checked and built in the thread too: 2,000 at a time is
        # milliseconds the event loop need not spend.
        wanted = list(keys)
        return await asyncio.to_thread(lambda: [self._path(k).is_file() for k in wanted])

    def _list(self, prefix: str) -> list[str]:
        # The prefix may end inside a name ("chunks/ab"): walk its directory part.
        check_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base if base else self.root
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if d != _LOCKS]
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel + "/"
            for name in filenames:
                if name.startswith(_TMP):
                    continue
                key = rel + name
                if key.startswith(prefix):
                    out.append(key)
        return out

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._list, prefix):
            yield key

    def _infos(self, prefix: str) -> list[ObjectInfo]:
        out = []
        for key in self._list(prefix):
            try:
                st = os.stat(self.root / key)
            except FileNotFoundError:
                continue  # deleted since it was listed
            except OSError as exc:
                if exc.errno not in DAMAGED_ERRNOS:
                    raise _read_failed(key, exc) from exc
                # Listed as the entry it is (a link that loops): a reader of it
                # gets StoreCorrupt, and a collection may still delete it.
                try:
                    st = os.lstat(self.root / key)
                except OSError:
                    raise _read_failed(key, exc) from exc
            out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return out

    async def list_info(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        for info in await asyncio.to_thread(self._infos, prefix):
            yield info

    async def list_dir(self, prefix: str) -> list[str]:
        def holds_objects(path: str) -> bool:
            # A directory whose objects were all deleted stays behind on disk; it is
            # not a name in the store (the memory store would not list it either).
            # Stops at the first object found, so a full directory costs one read.
            try:
                with os.scandir(path) as it:
                    subdirs = []
                    for e in it:
                        if e.name.startswith(_TMP):
                            continue
                        if _is_object(e):
                            return True
                        if e.is_dir():
                            subdirs.append(e.path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return any(holds_objects(d) for d in subdirs)

        def names() -> list[str]:
            base = self.root / prefix.rstrip("/")
            try:
                with os.scandir(base) as it:
                    entries = [e for e in it if not e.name.startswith(_TMP)]
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted(
                e.name
                for e in entries
                if not (base == self.root and e.name == _LOCKS)
                and (_is_object(e) or (e.is_dir() and holds_objects(e.path)))
            )

        if prefix:
            check_key(prefix.rstrip("/"))
        return await asyncio.to_thread(names)

    # -- writes ---------------------------------------------------------------------

    def _make_dirs(self, directory: Path) -> None:
        """Creates ``directory`` and its missing parents. With fsync, the parent of
        each one created is fsync'd too: a file fsync'd into a directory whose own
        name a crash lost is lost with it."""
        if directory.is_dir():
            return
        missing = []
        while not directory.exists() and directory != directory.parent:
            missing.append(directory)
            directory = directory.parent
        for made in reversed(missing):
            made.mkdir(exist_ok=True)  # (a concurrent writer may make it first)
            if self.fsync:
                _fsync_dir(made.parent)

    def _write_temp(self, path: Path, data: bytes | memoryview) -> Path:
        for attempt in range(3):
            self._make_dirs(path.parent)
            tmp = path.parent / f"{_TMP}{uuid.uuid4().hex}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except FileNotFoundError:
                # A deletion pruned the empty directory between its making and this
                # open (``_prune``): make it again.
                if attempt == 2:
                    raise
                continue
            try:
                try:
                    # Durable anyway, so a large object skips the page cache (direct_io).
                    direct_io.write_all(fd, data,
                                        direct=self.fsync and direct_io.worth_it(data))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)  # (a delayed write error may come here: NFS)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk must not also leak a temporary
                raise
            return tmp
        raise AssertionError("unreachable")

    def _prune(self, key: str) -> None:
        """Removes the directories a deletion left empty inside a step's
        (``jobs/<job>/steps/<n>/...``, the step's own too): retention deletes every
        document of a forgotten step, and a week of steps left a directory each.
        ``rmdir`` fails on a directory that is not empty, so nothing another writer
        put is touched; a writer that made a directory just before it went makes it
        again (``_write_temp``)."""
        parts = key.split("/")
        if len(parts) < 5 or parts[0] != "jobs" or parts[2] != "steps":
            return
        directory = self._path(key).parent
        stop = self.root.joinpath(*parts[:3])  # jobs/<job>/steps stays
        while directory != stop and stop in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (or gone): its parents are not empty either
            if self.fsync:
                with contextlib.suppress(OSError):
                    _fsync_dir(directory.parent)
            directory = directory.parent

    def _put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        if path.is_file():
            return False
        try:
            tmp = self._write_temp(path, data)
        except OSError as exc:
            raise _write_failed(key, exc) from exc
        try:
            os.link(tmp, path)  # atomic, and fails if another writer got there first
        except FileExistsError:
            return False
        except OSError as exc:
            raise _write_failed(key, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            try:
                _fsync_dir(path.parent)
            except OSError as exc:  # not durable: take it back rather than half-keep it
                path.unlink(missing_ok=True)
                raise _write_failed(key, exc) from exc
        return True

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return await asyncio.to_thread(self._put_if_absent, key, data)

    async def put_content(self, key: str, data: bytes | memoryview,
                          verify: Callable[[], None] | None = None) -> bool:
        if verify is None or type(self).put_if_absent is not LocalStore.put_if_absent:
            # (A subclass that wraps put_if_absent sees every put, chunks included.)
            return await super().put_content(key, data, verify)
        return await asyncio.get_running_loop().run_in_executor(
            content_writers(), self._verified_put, key, data, verify)

    def _verified_put(self, key: str, data: bytes | memoryview,
                      verify: Callable[[], None]) -> bool:
        verify()  # (the bytes' hash, in the thread that writes them)
        return self._put_if_absent(key, data)

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EISDIR:
                raise StoreError(f"cannot delete {key}: {_reason(exc)}", key=key) from exc
            return
        self._prune(key)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._delete, key)

    def _cad(self, key: str, expected: bytes) -> bool:
        path = self._path(key)
        with self._ref_lock(key):
            try:
                current = path.read_bytes()
            except FileNotFoundError:
                return False
            if current != expected:
                return False
            path.unlink()
            if self.fsync:
                _fsync_dir(path.parent)
            if key.endswith(_CLAIM):
                # A retention pass's removal claim, released: its lock file goes too
                # (one a removed step, for ever, otherwise). A pass that waited on
                # this file finds no claim and takes a new one (under a new file), as
                # it would after the release; two such passes at once both remove
                # the same documents, which is idempotent.
                with contextlib.suppress(FileNotFoundError):
                    self._lock_path(key).unlink()
        self._prune(key)
        return True

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        try:
            return await asyncio.to_thread(self._cad, key, expected)
        except OSError as exc:
            raise StoreError(f"cannot delete {key}: {_reason(exc)}", key=key) from exc

    def _lock_path(self, key: str) -> Path:
        return self.root / _LOCKS / key.replace("/", "%")

    @contextmanager
    def _ref_lock(self, key: str) -> Iterator[None]:
        """The lock that every compare-and-swap (and -delete) of ``key`` holds."""
        lock_dir = self.root / _LOCKS
        lock_dir.mkdir(exist_ok=True)
        with open(lock_dir / key.replace("/", "%"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def forget_ref_lock(self, key: str) -> None:
        """Removes the lock file the compare-and-swaps of ``key`` took: only for a key
        no process swaps again (the store probe's, new at every probe). A ref's stays:
        a process waiting on the old file and one creating a new one would both hold
        "the" lock."""
        with contextlib.suppress(FileNotFoundError):
            (self.root / _LOCKS / check_key(key).replace("/", "%")).unlink()

    def _cas(self, key: str, expected: bytes | None, new: bytes) -> bool:
        path = self._path(key)
        lock_dir = self.root / _LOCKS
        lock_dir.mkdir(exist_ok=True)
        lock_path = lock_dir / key.replace("/", "%")
        with open(lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                try:
                    current: bytes | None = path.read_bytes()
                except FileNotFoundError:
                    current = None
                if current != expected:
                    return False
                tmp = self._write_temp(path, new)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    tmp.unlink(missing_ok=True)  # not left behind beside the ref
                    raise
                if self.fsync:
                    _fsync_dir(path.parent)
                return True
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        try:
            return await asyncio.to_thread(self._cas, key, expected, new)
        except OSError as exc:
            raise _write_failed(key, exc, "update") from exc

    def describe(self) -> str:
        return f"file://{self.root}"
