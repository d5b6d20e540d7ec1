"""The restore tiers: where a chunk may come from (this rank's staging pool, a
local cache directory, live peers, the store), each a ``Source``; and what a
source that did not give a chunk right did (``ChunkProblem``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import mmap
import os
import stat
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import blake3
import numpy as np

from ckptd.errors import ChunkNotFound, ChunkSizeMismatch, StoreCorrupt, Timeout, Unavailable
from ckptd.format import TensorEntry, chunk_key
from ckptd.hashing import chunk_spans
from ckptd.pages import DAMAGED_ERRNOS, populate_read

from ..endpoint import cache_root
from ..loop import in_thread
from ..peer import PeerClient
from ..staging.format import SpanRecord
from ..staging.pool import StagingPool
from ..staging.reader import StagedPoolReader
from ..transport import LocalTransport, Transport
from .memory import ReadIn, fresh_bytes, span_of

if TYPE_CHECKING:
    from ckptd.store import Store


log = logging.getLogger(__name__)


# "object": the store tier's chunks read from an object store through presigned
# URLs (``direct.ObjectStoreSource``): asked for with "store", counted apart.
Tier = Literal["local", "cache", "peer", "store", "object"]


TIERS: tuple[Tier, ...] = ("local", "cache", "peer", "store")


ProblemKind = Literal["mismatch", "stale", "missing", "failed", "size", "damaged"]


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    """One source that did not give a chunk right: ``mismatch`` (bytes that do not
    hash to the id), ``stale`` (the local pool's bytes for it were overwritten since:
    a pool holds the last staged snapshot, not every step), ``size`` (wrong
    length), ``missing`` (the source lacks it) or ``failed`` (an error: a peer that
    went away, a store error)."""

    chunk: str
    tier: str
    source: str
    kind: ProblemKind
    message: str

    def to_json(self) -> dict[str, str]:
        return {"chunk": self.chunk, "tier": self.tier, "source": self.source,
                "kind": self.kind, "message": self.message}


class Source(ABC):
    """Where chunks may come from. ``holders`` names the places in this source
    that may hold a chunk, best first. A source whose bytes are already in this
    host's memory or page cache (``in_place``) gives a read-only ``view`` of them,
    hashed where it lies and copied only once everything verified; the others
    ``fetch_into`` a buffer. Both raise ``ChunkNotFound`` when the place lacks the
    chunk, another typed error when it fails; the engine verifies every byte."""

    tier: ClassVar[Tier]
    in_place: ClassVar[bool] = False

    @abstractmethod
    def holders(self, cid: str) -> Sequence[str]: ...

    async def view(self, holder: str, cid: str) -> memoryview:
        raise NotImplementedError

    def mapped(self, holder: str) -> memoryview | None:
        """The bytes ``holder`` holds when they are mapped already (no I/O to give
        them: the fetch hashes them in batches on its threads), else None."""
        return None

    async def fetch_into(self, holder: str, cid: str, dest: memoryview) -> str | None:
        """Fills ``dest``; may return the blake3 of what it wrote when it hashed it
        on the way (while the bytes are in cache), else None."""
        data = await self.view(holder, cid)
        if len(data) != len(dest):
            raise ChunkSizeMismatch(f"{holder} holds {len(data)} bytes for chunk {cid}, "
                                    f"expected {len(dest)}", id=cid)
        await in_thread(copy_bytes, dest, data)
        return None

    def outcome(self, holder: str, problem: ChunkProblem | None) -> None:  # noqa: B027
        """What came of a fetch from ``holder`` (None: verified)."""

    def close(self) -> None:  # noqa: B027
        """Releases what the source holds (maps, connections)."""


def verify_hash(data: memoryview) -> str:
    """A chunk's id, hashed on one thread: a restore hashes many chunks at once
    already, and blake3's own threads would only fight them for the cores."""
    return blake3.blake3(data).hexdigest()


def copy_bytes(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` without holding the GIL (numpy releases it for plain copies)."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class LocalPoolSource(Source):
    """This rank's staging pool in shared memory (``StagedPoolReader``).

    When the pool is consistent (its generation is the even one its index was
    written at), the chunk ids its index claims locate the chunks. Otherwise (a
    stage was overwriting it when the process died) every span of a tensor with
    the entry's name, dtype and shape is a candidate, and the hash decides."""

    tier = "local"
    in_place = True

    def __init__(
        self, reader: StagedPoolReader, entries: Iterable[tuple[TensorEntry, int]]
    ) -> None:
        self.reader = reader
        self.read_in: ReadIn | None = None  # (``PoolAhead``: stopped before the maps go)
        self.generation: int | None = reader.generation()
        self._views: dict[str, memoryview] = {}
        self._by_chunk: dict[str, list[str]] = {}
        self.step: int | None = reader.step
        consistent = bool(reader.consistent())
        spans: list[tuple[SpanRecord, memoryview]] = list(reader.spans())
        size = reader.index.chunk_size
        if consistent and size > 0:
            for entry, data in spans:
                for k, cid in enumerate(entry.chunks or ()):
                    view = data[k * size : (k + 1) * size]
                    self._add(cid, f"{entry.segment}@{entry.offset}#{entry.first_chunk + k}",
                              view)
        else:
            by_name: dict[str, list[tuple[SpanRecord, memoryview]]] = {}
            for entry, data in spans:
                by_name.setdefault(entry.name, []).append((entry, data))
            for e, chunk_size in entries:
                for entry, data in by_name.get(e.name, ()):
                    if entry.dtype != e.dtype or list(entry.shape) != list(e.shape):
                        continue
                    start, end = entry.start, entry.end
                    for k, (a, b) in enumerate(chunk_spans(e.nbytes, chunk_size)):
                        if a >= start and b <= end and b - a <= len(data) - (a - start):
                            self._add(e.chunks[k], f"{entry.segment}@{entry.offset}#{k}",
                                      data[a - start : b - start])
        log.debug("local pool %s: %d candidate chunks (%s)", reader.directory,
                  len(self._by_chunk), "indexed" if consistent else "by name")

    def _add(self, cid: str, label: str, view: memoryview) -> None:
        if label in self._views:
            return
        self._views[label] = view
        self._by_chunk.setdefault(cid, []).append(label)

    @classmethod
    def open(
        cls,
        job: str,
        rank: int,
        entries: Iterable[tuple[TensorEntry, int]],
        root: str | os.PathLike[str] | None = None,
        ahead: PoolAhead | None = None,
    ) -> LocalPoolSource | None:
        """The pool ``job``/``rank`` on this host, or None when there is none
        (``UnsupportedFormat`` for a pool of another version); ``ahead``: that pool,
        opened already (the source takes it over)."""
        if ahead is not None:
            source = cls(ahead.reader, entries)
            source.read_in, ahead.taken = ahead.read_in, True
            return source
        reader = StagingPool.open_existing(job, rank, root)
        if reader is None:
            return None
        return cls(reader, entries)

    def holders(self, cid: str) -> Sequence[str]:
        return self._by_chunk.get(cid, ())

    async def view(self, holder: str, cid: str) -> memoryview:
        return self._views[holder]

    def bytes_of(self, holder: str) -> memoryview:
        return self._views[holder]

    def mapped(self, holder: str) -> memoryview | None:
        return self._views.get(holder)

    def unchanged(self) -> bool:
        """True while nobody staged into the pool since it was opened (its views
        still hold the bytes that were verified)."""
        return bool(self.reader.generation() == self.generation)

    def close(self) -> None:
        if self.read_in is not None:
            self.read_in.stop()
        self._views = {}
        self._by_chunk = {}
        with contextlib.suppress(Exception):
            self.reader.close(unmap_later=True)


@dataclass(slots=True)
class PoolAhead:
    """This rank's staging pool opened before the restore plan is known, its pages
    read in meanwhile (``ReadIn``); a ``LocalPoolSource`` takes it over."""

    reader: StagedPoolReader
    read_in: ReadIn | None
    taken: bool = False

    @classmethod
    def open(cls, job: str, rank: int, root: str | os.PathLike[str] | None,
             threads: int) -> PoolAhead | None:
        """The pool, its pages being read in on ``threads`` threads; None when there
        is none or it cannot be read (the restore opens it again and says why)."""
        try:
            reader = StagingPool.open_existing(job, rank, root)
        except Exception:
            return None
        if reader is None:
            return None
        spans = [span_of(data) for _, data in reader.spans()]
        return cls(reader, ReadIn.start(spans, threads, [reader]))

    def stop(self) -> None:
        """Stops reading in (a pool of another step than the plan's)."""
        if self.read_in is not None:
            self.read_in.stop()

    def close(self) -> None:
        """Stops reading in and unmaps the pool, unless a source took it over."""
        if not self.taken:
            self.stop()
            self.reader.close(unmap_later=True)


class DirectoryCacheSource(Source):
    """A local directory store's chunk files (``<dir>/chunks/<id[0:2]>/<id>``),
    mapped read-only (from the page cache, without a copy until delivery).

    A map stays open until the source closes, and CPython's keeps a descriptor
    open with it: past ``max_maps`` (``map_budget()``: a quarter of the process's
    open-file limit), a chunk is read into fresh memory instead, so a restore of
    any size stays within the limit (1,024 files is a common one: 4 GiB of 4 MiB
    chunks). A map's pages are read in when it is made (``ckptd.pages``): one the
    disk cannot give back makes the chunk a ``read()``, which fails with EIO (the
    restore takes it from another tier), not a SIGBUS later."""

    tier: ClassVar[Tier] = "cache"
    in_place = True

    def __init__(self, root: str | os.PathLike[str], max_maps: int | None = None) -> None:
        self.root = Path(cache_root(root))
        self._maps: list[mmap.mmap] = []
        self.max_maps = map_budget() if max_maps is None else max_maps

    def _path(self, cid: str) -> Path:
        return self.root / chunk_key(cid)

    def holders(self, cid: str) -> Sequence[str]:
        path = self._path(cid)
        return (str(path),) if path.is_file() else ()

    async def view(self, holder: str, cid: str) -> memoryview:
        return await in_thread(self._map, Path(holder), cid)

    def _map(self, path: Path, cid: str) -> memoryview:
        try:
            return self._map_file(path, cid)
        except OSError as exc:
            if exc.errno not in DAMAGED_ERRNOS:
                raise
            # There, but its file does not read (a link that loops, the disk's read
            # error): that copy is damaged, and the next tier is asked.
            raise StoreCorrupt(f"cannot read {chunk_key(cid)} in {self.root}: "
                               f"{exc.strerror}", key=chunk_key(cid), id=cid) from None

    def _map_file(self, path: Path, cid: str) -> memoryview:
        try:
            # (not blocking: a FIFO at a chunk's path hung the restore in its open)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ChunkNotFound(f"chunk {cid} is not in {path.parent}", id=cid) from None
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):  # (no object, as the store contract has it)
                raise ChunkNotFound(f"chunk {cid} is not in {path.parent}", id=cid)
            if not stat.S_ISREG(info.st_mode):
                raise StoreCorrupt(f"cannot read {chunk_key(cid)} in {self.root}: not a "
                                   "regular file", key=chunk_key(cid), id=cid)
            size = info.st_size
            if size == 0:
                return memoryview(b"")
            if len(self._maps) >= self.max_maps:
                return _read_whole(fd, size)
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except OSError:  # out of maps or memory here: read it instead
                return _read_whole(fd, size)
            view = memoryview(mm)
            if not populate_read(view):
                # A page the disk cannot give back would be a SIGBUS in the hash or
                # the copy, and kill the training process: read() says EIO instead,
                # and the restore takes the chunk from another tier.
                view.release()
                mm.close()
                return _read_whole(fd, size)
        finally:
            os.close(fd)
        self._maps.append(mm)
        return view

    def close(self) -> None:
        for mm in self._maps:
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps = []


def map_budget() -> int:
    """How many chunk files one in-place source keeps mapped at once: a quarter of
    the soft limit on open files (each map holds a descriptor), at most 16,384
    (maps count against ``vm.max_map_count`` too)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = 1024
    if soft < 0:  # RLIM_INFINITY
        soft = 1 << 20
    return max(16, min(soft // 4, 16384))


def _read_whole(fd: int, size: int) -> memoryview:
    """A file's ``size`` bytes read into fresh memory (short reads continued; a file
    that ends early gives what it had, which the size check then refuses)."""
    buf = fresh_bytes(size)
    got = 0
    while got < size:
        n = os.preadv(fd, [buf[got:]], got)
        if n == 0:
            return buf[:got]
        got += n
    return buf


_GONE = frozenset({"unreachable", "disconnected", "timeout", "failed", "short"})


class PeerSource(Source):
    """Live peers of the restore plan. A chunk goes to the least busy peer that
    holds it (ties spread by the chunk id), at most ``per_peer`` requests per peer
    at once; a peer that is unreachable, went away or sent bad bytes is not asked
    again during this restore."""

    tier = "peer"

    def __init__(
        self,
        peers: Mapping[str, Sequence[str]],
        client: PeerClient,
        *,
        exclude: Iterable[str] = (),
        per_peer: int = 4,
        threads: int | None = None,
    ) -> None:
        skip = {u for u in exclude if u}
        self.peers = {cid: [u for u in urls if u not in skip] for cid, urls in peers.items()}
        self.client = client
        self.per_peer = max(1, per_peer)
        self.dead: set[str] = set()
        self.bad: set[str] = set()
        self.busy: dict[str, int] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        every = {u for urls in self.peers.values() for u in urls}
        workers = threads or max(2, min(32, len(every) * self.per_peer))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckptd-peer")

    @property
    def urls(self) -> set[str]:
        return {u for urls in self.peers.values() for u in urls}

    def holders(self, cid: str) -> Sequence[str]:
        urls = [u for u in self.peers.get(cid, ()) if u not in self.dead and u not in self.bad]
        return sorted(urls, key=lambda u: (self.busy.get(u, 0),
                                           zlib.crc32(f"{cid}{u}".encode())))

    def _fetch_and_hash(self, holder: str, cid: str, dest: memoryview) -> str:
        self.client.fetch_into(holder, cid, dest)
        return verify_hash(dest)  # in the same thread, while the bytes are in cache

    async def fetch_into(self, holder: str, cid: str, dest: memoryview) -> str | None:
        if holder in self.dead or holder in self.bad:
            raise Unavailable(f"peer {holder} was dropped earlier in this restore", peer=holder,
                              reason="dropped")
        slot = self._slots.setdefault(holder, asyncio.Semaphore(self.per_peer))
        self.busy[holder] = self.busy.get(holder, 0) + 1
        try:
            async with slot:
                loop = asyncio.get_running_loop()
                work = loop.run_in_executor(self._pool, self._fetch_and_hash, holder, cid, dest)
                try:
                    return await asyncio.shield(work)
                except asyncio.CancelledError:
                    # A deadline passed: no thread may go on receiving into ``dest``
                    # (the target's own memory when not atomic) after the caller
                    # returned. End the reads under way, then wait for them.
                    self.client.abort()
                    await asyncio.wait([work])
                    if not work.cancelled():
                        work.exception()  # (its failure is the abort's: not news)
                    raise
        except Unavailable as exc:
            # Refused, reset, timed out, cut short: the peer is gone (a 503 "busy"
            # carries no such reason and leaves it in the running).
            if exc.detail.get("reason") in _GONE and holder not in self.dead:
                log.warning("peer %s is gone (%s); not asking it again", holder, exc)
                self.dead.add(holder)
            raise
        finally:
            self.busy[holder] -= 1

    def outcome(self, holder: str, problem: ChunkProblem | None) -> None:
        if problem is not None and problem.kind in ("mismatch", "size"):
            if holder not in self.bad:
                log.warning("peer %s sent bad bytes for chunk %s; not asking it again",
                            holder, problem.chunk)
            self.bad.add(holder)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StoreSource(Source):
    """The repository, through a transport (the last tier)."""

    tier = "store"

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._read = transport.chunk_reader()
        # The chunks asked at once go in one request per replica (each verified in
        # the reading thread as it arrives).
        self._reads = transport.chunk_reads(verify_hash)
        # The transport's last word that no replica answers (its retries and
        # failover spent): the chunks asked after it fail at once. A server that
        # hangs (alive, its kernel acknowledging, nothing sent) cost every chunk its
        # own retries of a whole request timeout: hours for a large restore.
        self.unreachable: Unavailable | Timeout | None = None

    def holders(self, cid: str) -> Sequence[str]:
        return ("store",)

    async def fetch_into(self, holder: str, cid: str, dest: memoryview) -> str | None:
        if (gone := self.unreachable) is not None:
            raise type(gone)(f"not asked: {gone.message}", **gone.detail)
        try:
            return await self._fetch_into(cid, dest)
        except (Unavailable, Timeout) as exc:
            # (Not a server's own "try again shortly": it answers, and will again.)
            if self.unreachable is None and "retry_after_s" not in exc.detail:
                log.warning("the store is not answering (%s); the chunks left fail at once",
                            exc)
                self.unreachable = exc
            raise

    async def _fetch_into(self, cid: str, dest: memoryview) -> str | None:
        if self._reads is not None and not self._reads.refused:
            # As the direct read below: any failure goes the transport's way.
            try:
                return await self._reads.read(cid, dest)
            except Exception as exc:
                if (isinstance(exc, Unavailable) and exc.detail.get("reason") == "timeout"
                        and self._reads.alone()):
                    # A server that lets a whole request time out is hung (a lost host
                    # or a dead process is told apart sooner): one server, nowhere else.
                    raise Unavailable(f"the store's server {exc.detail.get('peer', '')} "
                                      f"stopped answering: {exc}",
                                      **{"url": exc.detail.get("peer"), **exc.detail}) from exc
                log.debug("batched read of chunk %s failed (%s); through the transport",
                          cid, exc)
        elif self._read is not None:
            # Straight into ``dest`` and hashed there, in one worker thread. Any
            # failure goes the transport's way below (its retries, replica
            # failover and typed errors); the bytes are verified either way.
            try:
                return await in_thread(_read_and_hash, self._read, cid, dest)
            except Exception as exc:
                log.debug("direct read of chunk %s failed (%s); through the transport",
                          cid, exc)
        data = await self.transport.get_chunk(cid)
        if len(data) != len(dest):
            raise ChunkSizeMismatch(f"the store has {len(data)} bytes for chunk {cid}, "
                                    f"expected {len(dest)}", id=cid)
        # Off the event loop, and hashed while the bytes are in cache.
        return await in_thread(copy_and_hash, dest, memoryview(data))

    def close(self) -> None:
        if self._reads is not None:
            self._reads.close()


def _read_and_hash(read: Callable[[str, memoryview], None], cid: str, dest: memoryview) -> str:
    read(cid, dest)
    return verify_hash(dest)


HASH_PIECE = 512 * 1024  # copied, then hashed while still in the core's own cache


def copy_and_hash(dest: memoryview, data: memoryview) -> str:
    """Copies ``data`` into ``dest`` and hashes ``dest`` while its bytes are in
    cache: piece by piece, each hashed right after its copy (a whole 4 MiB chunk
    no longer fits a core's cache; ~7% less CPU than copy, then hash)."""
    if len(data) <= HASH_PIECE:
        copy_bytes(dest, data)
        return verify_hash(dest)
    d, s = np.frombuffer(dest, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)
    if len(d) != len(s):
        raise ValueError(f"cannot copy {len(s)} bytes into {len(d)}")
    hasher = blake3.blake3()
    for a in range(0, len(s), HASH_PIECE):
        np.copyto(d[a : a + HASH_PIECE], s[a : a + HASH_PIECE])  # (no GIL while it copies)
        hasher.update(d[a : a + HASH_PIECE].data)
    return hasher.hexdigest()


class LocalStoreSource(DirectoryCacheSource):
    """The store, when it is a directory on this host (``file://``): its chunk files
    mapped read-only and hashed where they lie, then copied once into the target,
    like the cache tier. Reading them into fresh memory instead would cost more
    than the read itself (page faults), and the store is only ever read here."""

    tier = "store"

    def __init__(self, store: Store) -> None:
        super().__init__(".")
        self.store = store

    @classmethod
    def of(cls, transport: Transport) -> LocalStoreSource | None:
        """The in-place source of ``transport``'s store, or None when its chunks are
        not files on this host."""
        if not isinstance(transport, LocalTransport):
            return None
        store = transport.repository.store
        return cls(store) if store.local_path(chunk_key("0" * 64)) is not None else None

    def holders(self, cid: str) -> Sequence[str]:
        path = self.store.local_path(chunk_key(cid))
        return (str(path),) if path is not None else ()
