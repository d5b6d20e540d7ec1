"""Tiered, verified, elastic restore.

A restore takes each chunk of the committed state from the first source that has
it right, in tier order:

``local``
    this rank's staging pool in shared memory, left by the process that died (or
    held by this one): ``StagingPool.open_existing``. Its index is only a hint: a
    pool that a crash left half overwritten still gives its unchanged chunks, and
    only those.
``cache``
    a local directory store (``cache_dir``, ``CKPTD_CACHE_DIR``), e.g. what
    ``ckptd restore --to DIR`` fetched ahead of time in an init container.
``peer``
    live peers holding the step in their pools, from the server's restore plan,
    spread across them and fetched in parallel (``PeerClient``).
``store``
    the repository, through the checkpointer's transport; when that is a directory
    on this host (``file://``), its chunk files are mapped and hashed in place.

Every chunk is hashed and compared with its id before it is used; a source that
fails, lacks the chunk or has other bytes is recorded as a ``ChunkProblem`` and the
next one is tried (a peer that sent bad bytes or went away is not asked again
during that restore). The result is bitwise the committed state, or
``RestoreError`` / ``ChunkHashMismatch`` naming the entries and chunk ids that no
source had right. ``RestoreResult.bytes_from`` says how many bytes each tier gave.

Two phases. First every chunk is verified somewhere: the in-place tiers (pool,
cache) are hashed where they lie, without a copy; chunks from peers or the store
land in fresh memory (an assembly buffer they fill anyway, else landing memory
advised to use huge pages). Then, only when all verified, they are copied into
place: straight into the target's own tensors where those fit (contiguous CPU
tensors of the right dtype and shape), so a restore into a constructed model
allocates nothing for it. A failed restore leaves the target as it was.
``atomic=False`` lets chunks from peers and the store land in the target as they
verify: no landing memory and no second copy, but a restore that fails then leaves
the target partly restored (the error's ``partial`` detail says so). A live pool that a stage
overwrites during a restore (the seqlock generation changed) is not trusted: what
it gave is verified again or taken from the other tiers.

Elastic restore. The box each target tensor needs in its global tensor comes from
the target: a ``Shard`` passed to ``restore``, a ``DTensor``'s placements, or a
plain tensor (its own box when the world size is unchanged, the whole tensor when
its shape is the global shape). When that box is a stored entry's box, the entry's
chunks fill it directly. Otherwise (another world size, another sharding) every
committed rank manifest is read, the distinct stored boxes overlapping the needed
box are found, only the chunks covering the overlap's bytes are fetched, and the
slices are copied into place. Rank-local entries are never resharded.

``restore_command`` is ``ckptd restore --to DIR``: it pre-fetches one rank's
chunks (same tiers, same verification) into a local directory store, with the
rank's manifest and the commit record, so that a later restore can read them as
its ``cache`` tier or from ``file://DIR``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import mmap
import os
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import blake3
import numpy as np
import torch

from ckptd import knobs
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkNotFound,
    ChunkSizeMismatch,
    CkptdError,
    InvalidRequest,
    NotCommitted,
    RestoreError,
    Unavailable,
    UnsupportedFormat,
)
from ckptd.format import (
    CommitRecord,
    RankManifest,
    TensorEntry,
    canonical_json,
    check_job,
    check_rank,
    check_step,
    chunk_key,
)
from ckptd.hashing import chunk_id, chunk_spans, document_hash
from ckptd.knobs import MiB

from .peer import PeerClient, PeerIndex
from .restore_geometry import Box, slice_plan
from .sharding import dtensor_layout, is_dtensor
from .staging import StagedPoolReader, StagingPool
from .staging_format import SpanRecord
from .state import TensorSpec, byte_view, torch_dtype
from .transport import HttpTransport, LocalTransport, Transport

if TYPE_CHECKING:
    from ckptd.store import Store

log = logging.getLogger(__name__)

T = TypeVar("T")
Tier = Literal["local", "cache", "peer", "store"]
TIERS: tuple[Tier, ...] = ("local", "cache", "peer", "store")
HUGE_FROM = 4 * MiB  # fresh buffers this large come from huge-page-advised maps
ProblemKind = Literal["mismatch", "stale", "missing", "failed", "size", "damaged"]


# -- results --------------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What a restore did: the step, bytes and chunks restored, time, how many
    bytes came from each tier (``local``, ``cache``, ``peer``, ``store``), and the
    sources that failed on the way (each chunk still came from another)."""

    step: int
    bytes_restored: int
    chunks: int
    seconds: float
    bytes_from: dict[str, int] = field(default_factory=dict)
    problems: list[ChunkProblem] = field(default_factory=list)
    world_size: int | None = None  # the committed step's world size
    elastic: bool = False  # boxes were cut from other ranks' entries

    @property
    def bytes_fetched(self) -> int:
        return sum(self.bytes_from.values())


# -- sources --------------------------------------------------------------------------


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

    async def fetch_into(self, holder: str, cid: str, dest: memoryview) -> str | None:
        """Fills ``dest``; may return the blake3 of what it wrote when it hashed it
        on the way (while the bytes are in cache), else None."""
        data = await self.view(holder, cid)
        if len(data) != len(dest):
            raise ChunkSizeMismatch(f"{holder} holds {len(data)} bytes for chunk {cid}, "
                                    f"expected {len(dest)}", id=cid)
        await asyncio.to_thread(copy_bytes, dest, data)
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
    ) -> LocalPoolSource | None:
        """The pool ``job``/``rank`` on this host, or None when there is none
        (``UnsupportedFormat`` for a pool of another version)."""
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

    def unchanged(self) -> bool:
        """True while nobody staged into the pool since it was opened (its views
        still hold the bytes that were verified)."""
        return bool(self.reader.generation() == self.generation)

    def close(self) -> None:
        self._views = {}
        self._by_chunk = {}
        with contextlib.suppress(Exception):
            self.reader.close()


class DirectoryCacheSource(Source):
    """A local directory store's chunk files (``<dir>/chunks/<id[0:2]>/<id>``),
    mapped read-only (from the page cache, without a copy until delivery)."""

    tier: ClassVar[Tier] = "cache"
    in_place = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._maps: list[mmap.mmap] = []

    def _path(self, cid: str) -> Path:
        return self.root / chunk_key(cid)

    def holders(self, cid: str) -> Sequence[str]:
        path = self._path(cid)
        return (str(path),) if path.is_file() else ()

    async def view(self, holder: str, cid: str) -> memoryview:
        return await asyncio.to_thread(self._map, Path(holder), cid)

    def _map(self, path: Path, cid: str) -> memoryview:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ChunkNotFound(f"chunk {cid} is not in {path.parent}", id=cid) from None
        try:
            if os.fstat(fd).st_size == 0:
                return memoryview(b"")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._maps.append(mm)
        return memoryview(mm)

    def close(self) -> None:
        for mm in self._maps:
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps = []


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
                return await loop.run_in_executor(self._pool, self._fetch_and_hash, holder, cid,
                                                  dest)
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

    def holders(self, cid: str) -> Sequence[str]:
        return ("store",)

    async def fetch_into(self, holder: str, cid: str, dest: memoryview) -> str | None:
        data = await self.transport.get_chunk(cid)
        if len(data) != len(dest):
            raise ChunkSizeMismatch(f"the store has {len(data)} bytes for chunk {cid}, "
                                    f"expected {len(dest)}", id=cid)
        # Off the event loop, and hashed while the bytes are in cache.
        return await asyncio.to_thread(_copy_and_hash, dest, memoryview(data))


def _copy_and_hash(dest: memoryview, data: memoryview) -> str:
    copy_bytes(dest, data)
    return verify_hash(dest)


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


# -- the engine -----------------------------------------------------------------------


class Landing:
    """Fresh memory for chunks that arrive over the network and have no fresh
    buffer of their own to land in: anonymous maps in blocks, advised to use huge
    pages (fresh 4 KiB pages cost more than the copy into them)."""

    def __init__(self, block: int = 256 * MiB) -> None:
        self.block = block
        self._current: memoryview | None = None
        self._used = 0

    def take(self, n: int) -> memoryview:
        if self._current is None or self._used + n > len(self._current):
            self._current = fresh_bytes(max(n, self.block))
            self._used = 0
        view = self._current[self._used : self._used + n]
        self._used += n
        return view


def fresh_bytes(n: int) -> memoryview:
    """``n`` writable fresh bytes; large ones from an anonymous map advised to use
    transparent huge pages (the kernel then zeroes 2 MiB at a time)."""
    if n < HUGE_FROM:
        return memoryview(bytearray(n))
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mm)


def fresh_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones in huge-page-advised memory."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n < HUGE_FROM:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about its own writability checks
        flat = torch.frombuffer(fresh_bytes(n), dtype=torch.uint8)
    return flat.view(dtype).view(tuple(shape))


class ChunkFetcher:
    """Finds each chunk in the first source whose bytes verify: in place for
    in-place sources (the pool, the cache), else fetched into a landing buffer."""

    def __init__(self, sources: Sequence[Source], concurrency: int | None = None) -> None:
        self.sources = list(sources)
        self.concurrency = concurrency or knobs.restore_concurrency()
        self.bytes_from: dict[str, int] = {s.tier: 0 for s in self.sources}
        self.problems: list[ChunkProblem] = []
        self.failed: dict[str, list[ChunkProblem]] = {}
        self.tier_of: dict[str, str] = {}  # chunk id -> tier it came from
        self.holder_of: dict[str, str] = {}
        self.source_of: dict[str, Source] = {}
        self.landed_in_target = False

    async def locate(
        self, cid: str, size: int, land: Callable[[], memoryview]
    ) -> memoryview | None:
        """Verified bytes of chunk ``cid`` (a view where an in-place source holds
        them, or ``land()`` filled by a fetch), or None when no source had them
        right; every failed try is recorded."""
        mine: list[ChunkProblem] = []
        for source in self.sources:
            for holder in list(source.holders(cid)):
                problem: ChunkProblem | None = None
                data: memoryview | None = None
                hashed: str | None = None
                try:
                    if source.in_place:
                        data = await source.view(holder, cid)
                        if len(data) != size:
                            raise ChunkSizeMismatch(f"{holder} holds {len(data)} bytes, the "
                                                    f"chunk has {size}", id=cid)
                    else:
                        data = land()
                        hashed = await source.fetch_into(holder, cid, data)
                except ChunkNotFound as exc:
                    problem = ChunkProblem(cid, source.tier, holder, "missing", str(exc))
                except ChunkSizeMismatch as exc:
                    problem = ChunkProblem(cid, source.tier, holder, "size", str(exc))
                except ChunkHashMismatch as exc:  # a source that checks and says so
                    actual = exc.detail.get("actual")
                    problem = ChunkProblem(cid, source.tier, holder, "mismatch",
                                           f"bytes hash to {actual}" if actual else str(exc))
                except (CkptdError, OSError) as exc:
                    reason = exc.detail.get("reason") if isinstance(exc, CkptdError) else None
                    text = f"{type(exc).__name__}: {exc}" + (f" ({reason})" if reason else "")
                    problem = ChunkProblem(cid, source.tier, holder, "failed", text)
                else:
                    assert data is not None
                    actual = hashed or await asyncio.to_thread(verify_hash, data)
                    if actual != cid:
                        kind: ProblemKind = "stale" if source.tier == "local" else "mismatch"
                        problem = ChunkProblem(cid, source.tier, holder, kind,
                                               f"bytes hash to {actual}")
                source.outcome(holder, problem)
                if problem is None:
                    assert data is not None
                    self.bytes_from[source.tier] = self.bytes_from.get(source.tier, 0) + size
                    self.tier_of[cid] = source.tier
                    self.holder_of[cid] = holder
                    self.source_of[cid] = source
                    self.problems.extend(mine)
                    return data
                if problem.kind != "missing" or source.tier in ("peer", "store"):
                    mine.append(problem)
        self.problems.extend(mine)
        self.failed[cid] = mine
        return None

    async def fetch(self, cid: str, dest: memoryview) -> str | None:
        """Fills ``dest`` with verified chunk ``cid``; the tier it came from, or None."""
        data = await self.locate(cid, len(dest), lambda: dest)
        if data is None:
            return None
        if data.obj is not dest.obj or _address(data) != _address(dest):
            await asyncio.to_thread(copy_bytes, dest, data)
        return self.tier_of[cid]

    async def locate_all(self, wanted: _Wanted, atomic: bool = True) -> dict[str, memoryview]:
        """Verified bytes of every wanted chunk (failures are left in ``failed``).

        ``atomic``: nothing is written into the target; a chunk fetched over the
        network lands in a fresh buffer it fills anyway, or in landing memory.
        Otherwise it lands in its first destination, the target's own tensor
        included (``landed_in_target`` records that)."""
        landing = Landing()
        found: dict[str, memoryview] = {}

        async def one(cid: str) -> None:
            dests = wanted.chunks[cid]
            size = len(dests[0][0])
            spot: list[memoryview] = []

            def land() -> memoryview:
                if not spot:
                    fresh = next((d for d, in_target in dests if not in_target), None)
                    if fresh is None and not atomic:
                        fresh = dests[0][0]
                        self.landed_in_target = True
                    spot.append(fresh if fresh is not None else landing.take(size))
                return spot[0]

            data = await self.locate(cid, size, land)
            if data is None:
                return
            source = self.source_of[cid]
            if not atomic and source.in_place and source.tier != "local":
                # Lands as it verifies, like a network chunk (the pool's views are
                # kept: they are what an adopted pool serves to peers).
                dest, in_target = dests[0]
                await asyncio.to_thread(copy_bytes, dest, data)
                self.landed_in_target = self.landed_in_target or in_target
                data = dest
            found[cid] = data

        from .pipeline import bounded

        await bounded(list(wanted.chunks), one, self.concurrency)
        return found

    def close(self) -> None:
        for s in self.sources:
            s.close()


def _address(view: memoryview) -> int:
    """Where a writable or read-only buffer's bytes start (to tell if two views
    are the same memory)."""
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


async def deliver(found: Mapping[str, memoryview], wanted: _Wanted, concurrency: int = 2) -> None:
    """Copies every verified chunk to each of its destinations (the target's own
    tensors where they fit), then the slices of elastic boxes."""
    jobs: list[tuple[memoryview, memoryview]] = []
    for cid, dests in wanted.chunks.items():
        data = found[cid]
        here = _address(data)
        for dest, _ in dests:
            if len(dest) and _address(dest) != here:
                jobs.append((dest, data))

    async def copy(job: tuple[memoryview, memoryview]) -> None:
        await asyncio.to_thread(copy_bytes, *job)

    from .pipeline import bounded

    await bounded(jobs, copy, concurrency)
    with torch.no_grad():
        for dst, src in wanted.copies:
            dst.copy_(src)


# -- boxes and what to fetch -----------------------------------------------------------


@dataclass(slots=True)
class _Wanted:
    """Chunk id -> the buffers it fills, and the slice copies to make afterwards."""

    # chunk id -> (destination, whether it is the target's own memory)
    chunks: dict[str, list[tuple[memoryview, bool]]] = field(default_factory=dict)
    names: dict[str, set[str]] = field(default_factory=dict)  # chunk id -> entry names
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # dst, src
    elastic: bool = False

    def add(self, cid: str, dest: memoryview, name: str, in_target: bool = False) -> None:
        self.chunks.setdefault(cid, []).append((dest, in_target))
        self.names.setdefault(cid, set()).add(name)

    def size(self, cid: str) -> int:
        return len(self.chunks[cid][0][0])


def _fill_from_entry(wanted: _Wanted, name: str, buf: torch.Tensor, box: Box,
                     e: TensorEntry, chunk_size: int, in_target: bool) -> int:
    """Plans filling the part of ``buf`` (the needed ``box``; the target's own
    tensor when ``in_target``) that stored entry ``e`` overlaps; the number of
    elements it covers."""
    (bo, bs), eo, es = box, tuple(e.offsets), tuple(e.shape)
    if (bo, bs) == (eo, es):
        view = byte_view(buf)
        for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, chunk_size), strict=True):
            wanted.add(cid, view[a:b], name, in_target)
        return math.prod(bs)
    itemsize = buf.element_size()
    plan = slice_plan(box, (eo, es), itemsize, chunk_size)
    if plan is None:
        return 0
    wanted.elastic = True
    flat = fresh_tensor((plan.length // itemsize,), buf.dtype)
    fview = byte_view(flat)
    for k, index in enumerate(plan.chunks):
        a, b = plan.landing(k)
        wanted.add(e.chunks[index], fview[a:b], name)
    src = flat.as_strided(plan.shape, plan.strides, plan.offset)
    dst = buf[tuple(slice(o, o + n) for o, n in zip(plan.dst_offsets, plan.shape, strict=True))]
    wanted.copies.append((dst, src))
    return math.prod(plan.shape)


def _target_values(tree: Mapping[str, Any], target: Any) -> dict[str, Any]:
    """Tensor name -> what the target holds at that place of the tree (or None)."""
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], existing: Any) -> None:
        ((kind, body),) = node.items()
        if kind == "tensor":
            out[body] = existing
        elif kind == "bytes":
            out[body] = None  # a blob is rebuilt, never filled in place
        elif kind == "dict":
            for key, child in body:
                ok = isinstance(existing, Mapping) and key in existing
                walk(child, existing[key] if ok else None)
        elif kind in ("list", "tuple"):
            seq = existing if isinstance(existing, Sequence) and not isinstance(
                existing, str | bytes) else ()
            for i, child in enumerate(body):
                walk(child, seq[i] if i < len(seq) else None)

    walk(tree, target)
    return out


def _shape_of(value: Any) -> tuple[int, ...] | None:
    if is_dtensor(value):
        return tuple(int(d) for d in value.to_local().shape)
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    return None


def needed_box(
    e: TensorEntry,
    existing: Any,
    shard: Any | None,
    same_world: bool,
) -> Box:
    """The box of global tensor ``e.name`` that the target needs (see the module
    docstring). ``e`` is the entry of the manifest whose tree is restored."""
    own: Box = (tuple(e.offsets), tuple(e.shape))
    g = tuple(e.global_shape)
    whole: Box = ((0,) * len(g), g)
    if e.placement == "local":
        return own
    if shard is not None:
        sg, so = tuple(shard.global_shape), tuple(shard.offsets)
        if sg != g:
            raise RestoreError(f"{e.name!r}: the Shard says global shape {list(sg)}, the "
                               f"checkpoint {list(g)}", entries=[e.name])
        shape = _shape_of(existing)
        if shape is None:
            raise RestoreError(f"{e.name!r} has a Shard but the target holds no tensor there, "
                               "so the shard's shape is unknown", entries=[e.name])
        box: Box = (so, shape)
    elif is_dtensor(existing):
        _, dg, do = dtensor_layout(existing, repr(e.name))
        if tuple(dg) != g:
            raise RestoreError(f"{e.name!r}: the target DTensor's global shape is {dg}, the "
                               f"checkpoint's {list(g)}", entries=[e.name])
        box = (tuple(do), _shape_of(existing) or ())
    elif isinstance(existing, torch.Tensor):
        shape = tuple(int(d) for d in existing.shape)
        if shape == own[1] and (same_world or e.placement == "replicated"):
            return own
        if shape == g:
            return whole
        if same_world or e.placement == "replicated":
            return own  # the shapes differ: plan_fill names it
        raise RestoreError(
            f"{e.name!r}: the checkpoint holds shards of a {list(g)} tensor saved by another "
            f"world size and the target holds a {list(shape)} tensor; pass its Shard (or use "
            "a DTensor) so the restore knows which box it needs",
            entries=[e.name],
        )
    else:
        return own if same_world else whole
    if len(box[0]) != len(g) or len(box[1]) != len(g) or any(
        o < 0 or o + s > d for o, s, d in zip(box[0], box[1], g, strict=True)
    ):
        raise RestoreError(f"{e.name!r}: box {list(box[1])} at {list(box[0])} does not fit "
                           f"global shape {list(g)}", entries=[e.name])
    return box


# -- planning ---------------------------------------------------------------------------


@dataclass(slots=True)
class RestorePlan:
    """A committed step to restore, this rank's manifest, and who holds its chunks."""

    job: str
    step: int
    rank: int  # the rank whose manifest gives the tree
    record: CommitRecord
    manifest: RankManifest
    peers: dict[str, list[str]] = field(default_factory=dict)
    manifests: dict[int, RankManifest] = field(default_factory=dict)  # every rank, when read
    peer_token: str | None = None  # the job's peer token, from the server's plan
    # Damaged documents that made "latest" an older step (see restorable_step).
    fallback: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.record.world_size


async def resolve_step(transport: Transport, job: str, step: int | None) -> int:
    if step is not None:
        return check_step(step)
    latest = await transport.latest(job)
    if latest is None:
        raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
    return latest


async def fetch_restore_plan(
    transport: Transport, job: str, rank: int, step: int
) -> tuple[RankManifest | None, dict[str, list[str]], str | None, str | None]:
    """The server's restore plan for ``rank`` at ``step``: its manifest (None when
    the server sent none), the peers holding each chunk, the manifest's hash, and
    the job's peer token (what those peers require).
    An HTTP transport only; a server without the route gives no peers."""
    if not isinstance(transport, HttpTransport):
        return None, {}, None, None
    try:
        doc = await transport.restore_plan(job, rank, step)
    except (CheckpointNotFound, NotCommitted):
        raise
    except CkptdError as exc:
        log.info("no restore plan from %s (%s); restoring without peers", transport.url, exc)
        return None, {}, None, None
    peers_doc = doc.get("peers") or {}
    peers = {str(cid): [str(u) for u in urls if isinstance(u, str)]
             for cid, urls in peers_doc.items() if isinstance(urls, list)}
    manifest = None
    digest = doc.get("manifest_hash")
    body = doc.get("manifest")
    if isinstance(body, dict):
        try:
            manifest = RankManifest.parse(canonical_json(body))
        except (CkptdError, TypeError, ValueError) as exc:
            log.warning("restore plan's manifest does not parse (%s); reading it", exc)
    token = doc.get("peer_token")
    return (manifest, peers, digest if isinstance(digest, str) else None,
            token if isinstance(token, str) else None)


async def load_plan(
    transport: Transport, job: str, rank: int, step: int | None, *, with_peers: bool = True
) -> RestorePlan:
    """Resolves the step, refuses a step that never committed, and reads the
    manifest whose tree is restored (this rank's; rank 0's when this rank is
    outside the committed world) with the peers that hold its chunks."""
    fallback: list[str] = []
    if step is None:
        found, fallback = await transport.restorable(job)
        if found is None:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
        step = found
    step = await resolve_step(transport, job, step)
    record = await transport.read_commit(job, step)  # NotCommitted, CheckpointNotFound
    source_rank = rank if rank < record.world_size else 0
    manifest: RankManifest | None = None
    peers: dict[str, list[str]] = {}
    peer_token = None
    if with_peers:
        manifest, peers, _, peer_token = await fetch_restore_plan(
            transport, job, source_rank, step)
    expected = record.manifests[source_rank].hash
    if manifest is not None and document_hash(manifest.canonical()) != expected:
        log.warning("restore plan's manifest of rank %d is not the committed one; reading it",
                    source_rank)
        manifest = None
    if manifest is None or (manifest.job, manifest.step, manifest.rank) != (
        job, step, source_rank
    ):
        manifest = await transport.read_manifest(job, step, source_rank)
    plan = RestorePlan(job, step, source_rank, record, manifest, peers, peer_token=peer_token,
                       fallback=fallback)
    plan.manifests[source_rank] = manifest
    return plan


async def load_all_manifests(transport: Transport, plan: RestorePlan, with_peers: bool) -> None:
    """Reads every rank's manifest of the plan's step (and their peers)."""

    async def one(r: int) -> None:
        if r in plan.manifests:
            return
        manifest: RankManifest | None = None
        if with_peers:
            manifest, peers, _, token = await fetch_restore_plan(transport, plan.job, r,
                                                                 plan.step)
            plan.peer_token = plan.peer_token or token
            for cid, urls in peers.items():
                have = plan.peers.setdefault(cid, [])
                have.extend(u for u in urls if u not in have)
            if manifest is not None and document_hash(manifest.canonical()) != (
                plan.record.manifests[r].hash
            ):
                manifest = None
        if manifest is None:
            manifest = await transport.read_manifest(plan.job, plan.step, r)
        plan.manifests[r] = manifest

    await asyncio.gather(*(one(r) for r in range(plan.world_size)))


# -- layout: what the target needs --------------------------------------------------


@dataclass(slots=True)
class RestoreLayout:
    """The tree to restore, the spec and assembly buffer of each tensor, and the
    chunks to fetch into those buffers."""

    tree: dict[str, Any]
    specs: dict[str, TensorSpec]
    buffers: dict[str, torch.Tensor]
    wanted: _Wanted
    entries: list[tuple[TensorEntry, int]]  # every stored entry read from (for the pool)


def needed_boxes(
    plan: RestorePlan,
    target: Any,
    shards: Mapping[str, Any],
    world_size: int,
) -> tuple[dict[str, Box], bool]:
    """The box each tensor of the plan's tree needs; and whether some box is not an
    entry of the plan's manifest (so every rank's manifest must be read)."""
    same_world = world_size == plan.world_size and plan.rank < world_size
    values = _target_values(plan.manifest.tree, target)
    boxes: dict[str, Box] = {}
    other = False
    for e in plan.manifest.entries:
        box = needed_box(e, values.get(e.name), shards.get(e.name), same_world)
        boxes[e.name] = box
        other = other or box != (tuple(e.offsets), tuple(e.shape))
    return boxes, other


def _direct(existing: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether the restore may assemble straight into the target's tensor (once
    every chunk verified): a dense, contiguous CPU tensor of the right dtype and
    shape, so that its bytes are the entry's bytes."""
    return (
        isinstance(existing, torch.Tensor)
        and not is_dtensor(existing)
        and existing.device.type == "cpu"
        and existing.layout == torch.strided
        and existing.dtype == dtype
        and tuple(existing.shape) == shape
        and existing.is_contiguous()
        and not existing.is_conj()
        and not existing.is_neg()
        and existing.numel() > 0
    )


def build_layout(
    plan: RestorePlan, boxes: Mapping[str, Box], values: Mapping[str, Any] | None = None
) -> RestoreLayout:
    """Where every tensor of the plan's tree is assembled (the target's own tensor
    when it fits, else fresh memory) and the chunks (of the plan's manifests) that
    fill it."""
    manifest = plan.manifest
    cs = manifest.chunk_size
    values = values or {}
    wanted = _Wanted()
    specs: dict[str, TensorSpec] = {}
    buffers: dict[str, torch.Tensor] = {}
    used: dict[tuple[str, int], tuple[TensorEntry, int]] = {}
    # Stored boxes of every global tensor across the manifests read, one per box;
    # this rank's own manifest first (its pool holds those chunks).
    order = [plan.rank] + sorted(r for r in plan.manifests if r != plan.rank)
    stored: dict[str, dict[Box, tuple[TensorEntry, int]]] = {}
    for r in order:
        m = plan.manifests[r]
        for e in m.entries:
            if e.placement == "local":
                continue
            stored.setdefault(e.name, {}).setdefault(
                (tuple(e.offsets), tuple(e.shape)), (e, m.chunk_size))
    for e in manifest.entries:
        box = boxes[e.name]
        dtype = torch_dtype(e.dtype)
        existing = values.get(e.name)
        in_target = _direct(existing, dtype, box[1])
        buf = existing if in_target and isinstance(existing, torch.Tensor) else fresh_tensor(
            box[1], dtype)
        buffers[e.name] = buf
        specs[e.name] = TensorSpec(dtype, box[1], tuple(e.global_shape), box[0])
        if e.placement == "local" or box == (tuple(e.offsets), tuple(e.shape)):
            _fill_from_entry(wanted, e.name, buf, box, e, cs, in_target)
            used[(e.name, id(e))] = (e, cs)
            continue
        covered = 0
        for (se, scs) in stored.get(e.name, {}).values():
            if se.dtype != e.dtype or tuple(se.global_shape) != tuple(e.global_shape):
                raise RestoreError(f"{e.name!r}: ranks disagree on its dtype or global shape",
                                   entries=[e.name])
            n = _fill_from_entry(wanted, e.name, buf, box, se, scs, in_target)
            if n:
                covered += n
                used[(se.name, id(se))] = (se, scs)
        if covered != math.prod(box[1]):
            raise RestoreError(
                f"{e.name!r}: the stored shards cover {covered} of the {math.prod(box[1])} "
                f"elements of the box {list(box[1])} at {list(box[0])}",
                entries=[e.name],
            )
    return RestoreLayout(manifest.tree, specs, buffers, wanted, list(used.values()))


def failure(fetcher: ChunkFetcher, wanted: _Wanted, step: int) -> CkptdError:
    """The typed error for chunks no source had right."""
    ids = sorted(fetcher.failed)
    names = sorted({n for cid in ids for n in wanted.names.get(cid, ())})
    problems = [p.to_json() for cid in ids[:20] for p in fetcher.failed[cid]]
    def corrupt_only(problems: list[ChunkProblem]) -> bool:
        seen = [p for p in problems if p.kind != "stale"]
        return bool(seen) and all(p.kind == "mismatch" for p in seen)

    corrupt = [cid for cid in ids if corrupt_only(fetcher.failed[cid])]
    where = ", ".join(map(repr, names[:5])) + (" ..." if len(names) > 5 else "")
    if corrupt and len(corrupt) == len(ids):
        first = corrupt[0]
        actual = [p for p in fetcher.failed[first] if p.kind == "mismatch"][-1].message
        actual = actual.removeprefix("bytes hash to ")
        return ChunkHashMismatch(
            f"chunk {first} of {where} arrived corrupt from every source "
            f"({len(ids)} chunks in all)",
            id=first, actual=actual, ids=ids[:100], entries=names[:50], problems=problems,
            step=step,
        )
    return RestoreError(
        f"{len(ids)} chunks of {where} could not be restored from any source "
        f"(first: {ids[0]})",
        ids=ids[:100], entries=names[:50], problems=problems, step=step,
    )


# -- the whole restore, for a Checkpointer ------------------------------------------------


@dataclass(slots=True)
class RestoreOptions:
    """Which tiers a restore uses and how."""

    local: bool = True
    pool_root: str | os.PathLike[str] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    peers: bool = True
    store: bool = True
    exclude_peers: tuple[str, ...] = ()
    token: str | None = None
    concurrency: int | None = None
    peer_timeout: float | None = None
    atomic: bool = True  # nothing reaches the target before every chunk verified


@dataclass(slots=True)
class Fetched:
    """Assembled, verified tensors of a layout, and what the fetch did."""

    tensors: dict[str, torch.Tensor]
    chunks: int
    bytes_from: dict[str, int]
    problems: list[ChunkProblem]
    adopted: PeerIndex | None  # verified chunks of this rank's pool, to serve to peers
    pool: LocalPoolSource | None  # keeps the adopted views mapped


def make_sources(
    transport: Transport,
    plan: RestorePlan,
    layout_entries: Iterable[tuple[TensorEntry, int]],
    opts: RestoreOptions,
    pool_rank: int,
) -> tuple[list[Source], LocalPoolSource | None]:
    sources: list[Source] = []
    pool = None
    if opts.local:
        try:
            pool = LocalPoolSource.open(plan.job, pool_rank, layout_entries, opts.pool_root)
        except Exception as exc:  # a pool we cannot read is a pool we do not have
            log.warning("cannot read the staging pool of %s/%d: %s", plan.job, pool_rank, exc)
            pool = None
        if pool is not None:
            sources.append(pool)
    cache = opts.cache_dir if opts.cache_dir is not None else knobs.cache_dir()
    if cache:
        sources.append(DirectoryCacheSource(cache))
    if opts.peers and plan.peers:
        # The job's peer token from the plan: never this client's server token.
        client = PeerClient(plan.peer_token, timeout=opts.peer_timeout)
        sources.append(PeerSource(plan.peers, client, exclude=opts.exclude_peers))
    if opts.store:
        sources.append(LocalStoreSource.of(transport) or StoreSource(transport))
    return sources, pool


async def fetch_layout(
    transport: Transport, plan: RestorePlan, layout: RestoreLayout, opts: RestoreOptions,
    pool_rank: int,
) -> Fetched:
    """Fetches and verifies every chunk of ``layout`` through the tiers and
    assembles the tensors; raises (nothing assembled) when a chunk had no good
    source."""
    sources, pool = make_sources(transport, plan, layout.entries, opts, pool_rank)
    fetcher = ChunkFetcher(sources, opts.concurrency)
    keep_pool = False
    wanted = layout.wanted
    t0 = time.perf_counter()
    try:
        # Phase 1: every chunk verified somewhere; nothing written into the target
        # (unless not atomic: chunks from the network land in it as they verify).
        found = await fetcher.locate_all(wanted, opts.atomic)
        t1 = time.perf_counter()
        if fetcher.failed:
            err = failure(fetcher, wanted, plan.step)
            if fetcher.landed_in_target:
                err.detail["partial"] = True
                err.message = err.args[0] + "; the target is partly restored (atomic=False)"
                err.args = (err.message,)
            raise err
        if pool is not None and not pool.unchanged():
            # A live owner staged into the pool meanwhile: what was verified there
            # may be gone. Take those chunks from the other tiers.
            await _relocate(fetcher, wanted, found, [s for s in sources if s is not pool])
        # Phase 2: deliver (into the target's own tensors where they fit).
        await deliver(found, wanted)
        log.debug("%s step %d: chunks verified in %.3f s, delivered in %.3f s", plan.job,
                  plan.step, t1 - t0, time.perf_counter() - t1)
        if pool is not None and not pool.unchanged():
            await _recheck(fetcher, wanted, [s for s in sources if s is not pool])
        adopted = None
        if pool is not None and pool.unchanged():
            verified = {cid: found[cid] for cid, tier in fetcher.tier_of.items()
                        if tier == "local"}
            if verified:
                # Served while nobody stages into that pool (its seqlock generation).
                adopted = PeerIndex(step=plan.step, chunks=verified, valid=pool.unchanged)
                keep_pool = True
        return Fetched(
            tensors=layout.buffers,
            chunks=len(wanted.chunks),
            bytes_from=dict(fetcher.bytes_from),
            problems=list(fetcher.problems),
            adopted=adopted,
            pool=pool if keep_pool else None,
        )
    finally:
        for s in sources:
            if s is pool and keep_pool:
                continue
            s.close()
            if isinstance(s, PeerSource):
                s.client.close()


async def _relocate(fetcher: ChunkFetcher, wanted: _Wanted, found: dict[str, memoryview],
                    others: Sequence[Source]) -> None:
    """Finds again, in ``others``, the chunks that were found in the local pool."""
    local = [cid for cid, tier in fetcher.tier_of.items() if tier == "local"]
    log.warning("the staging pool changed during the restore; %d chunks from other tiers",
                len(local))
    again = ChunkFetcher(others, fetcher.concurrency)
    landing = Landing()
    for cid in local:
        fetcher.bytes_from["local"] -= wanted.size(cid)
        size = wanted.size(cid)
        data = await again.locate(cid, size, functools.partial(landing.take, size))
        if data is None:
            fetcher.failed[cid] = again.failed[cid]
        else:
            found[cid] = data
            fetcher.tier_of[cid] = again.tier_of[cid]
    for tier, n in again.bytes_from.items():
        fetcher.bytes_from[tier] = fetcher.bytes_from.get(tier, 0) + n
    fetcher.problems.extend(again.problems)
    if fetcher.failed:
        raise failure(fetcher, wanted, -1)


async def _recheck(fetcher: ChunkFetcher, wanted: _Wanted, others: Sequence[Source]) -> None:
    """The pool changed while it was being copied out: re-hashes what it gave,
    where it landed, and fetches again from ``others`` whatever no longer verifies."""
    again = ChunkFetcher(others, fetcher.concurrency)
    for cid, tier in list(fetcher.tier_of.items()):
        if tier != "local":
            continue
        for dest, _ in wanted.chunks[cid]:
            if await asyncio.to_thread(chunk_id, dest) == cid:
                continue
            if await again.fetch(cid, dest) is None:
                raise failure(again, wanted, -1)
    fetcher.problems.extend(again.problems)


def restore_into(
    call: Callable[[Coroutine[Any, Any, Any]], Any],
    transport: Transport,
    state: Any,
    *,
    job: str,
    rank: int,
    world_size: int,
    step: int | None = None,
    shards: Mapping[str, Any] | None = None,
    opts: RestoreOptions | None = None,
) -> tuple[RestoreResult, Fetched]:
    """Restores ``state`` in place (see ``Checkpointer.restore``); ``call`` runs a
    coroutine on the loop the transport lives on and returns its result."""
    from .state import fill, plan_fill

    t0 = time.perf_counter()
    opts = opts or RestoreOptions()
    plan: RestorePlan = call(load_plan(transport, job, rank, step, with_peers=opts.peers))
    t_plan = time.perf_counter()
    if plan.rank != rank:
        log.warning("%s/%d: step %d was saved by %d ranks; rank-local entries come from "
                    "rank %d", job, rank, plan.step, plan.world_size, plan.rank)
    boxes, other = needed_boxes(plan, state, shards or {}, world_size)
    if other:
        call(load_all_manifests(transport, plan, opts.peers))
    values = _target_values(plan.manifest.tree, state)
    layout = build_layout(plan, boxes, values)
    plan_fill(state, layout.tree, layout.specs)  # refuses before anything changes
    t_layout = time.perf_counter()
    fetched: Fetched = call(fetch_layout(transport, plan, layout, opts, rank))
    t_fetch = time.perf_counter()
    fill(state, layout.tree, fetched.tensors)
    log.debug("%s/%d: plan %.3f s, layout %.3f s, fetch %.3f s, fill %.3f s", job, rank,
              t_plan - t0, t_layout - t_plan, t_fetch - t_layout, time.perf_counter() - t_fetch)
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in fetched.tensors.values())
    result = RestoreResult(
        step=plan.step,
        bytes_restored=nbytes,
        chunks=fetched.chunks,
        seconds=seconds,
        bytes_from=fetched.bytes_from,
        problems=[*fallback_problems(plan), *fetched.problems],
        world_size=plan.world_size,
        elastic=layout.wanted.elastic,
    )
    log.info("%s/%d: restored step %d, %d bytes in %d chunks, %.3f s (%s)%s", job, rank,
             plan.step, nbytes, fetched.chunks, seconds,
             ", ".join(f"{t} {n}" for t, n in fetched.bytes_from.items() if n),
             f", {len(fetched.problems)} source problems" if fetched.problems else "")
    return result, fetched


def fallback_problems(plan: RestorePlan) -> list[ChunkProblem]:
    """The damaged documents that made a restore of "latest" use an older step."""
    return [
        ChunkProblem(chunk="", tier="store", source="latest", kind="damaged", message=m)
        for m in plan.fallback
    ]


async def adopt_pool(
    transport: Transport, job: str, rank: int, step: int | None,
    pool_root: str | os.PathLike[str] | None = None,
) -> tuple[int, PeerIndex | None, LocalPoolSource | None]:
    """Verifies this rank's staging pool against the manifest of a committed step
    (the latest when None), hashing in place: (step, the verified chunks as a
    ``PeerIndex``, the source keeping them mapped). No pool or no match: None."""
    step = await resolve_step(transport, job, step)
    record = await transport.read_commit(job, step)
    if rank >= record.world_size:
        return step, None, None
    manifest = await transport.read_manifest(job, step, rank)
    entries = [(e, manifest.chunk_size) for e in manifest.entries]
    try:
        pool = LocalPoolSource.open(job, rank, entries, pool_root)
    except UnsupportedFormat as exc:  # another ckptd's pool: nothing to adopt
        log.warning("%s/%d: %s", job, rank, exc)
        return step, None, None
    if pool is None:
        return step, None, None
    needed = manifest.chunk_ids()
    verified: dict[str, memoryview] = {}

    def check() -> None:
        for cid in needed:
            for holder in pool.holders(cid):
                view = pool.bytes_of(holder)
                if chunk_id(view) == cid:
                    verified[cid] = view
                    break

    await asyncio.to_thread(check)
    if not verified:
        pool.close()
        return step, None, None
    log.info("%s/%d: staging pool holds %d of %d chunks of step %d", job, rank,
             len(verified), len(needed), step)
    return step, PeerIndex(step=step, chunks=verified, valid=pool.unchanged), pool


# -- ckptd restore --to DIR -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What ``restore_command`` put into its directory."""

    job: str
    rank: int
    step: int
    directory: str
    chunks: int
    bytes: int
    seconds: float
    bytes_from: dict[str, int]
    problems: list[ChunkProblem]


def restore_command(
    url: str,
    job: str,
    rank: int,
    to: str | os.PathLike[str],
    *,
    step: int | None = None,
    token: str | None = None,
    local: bool = True,
    peers: bool = True,
    progress: bool = True,
    console: Any | None = None,
    timeout: float | None = None,
) -> PrefetchResult:
    """``ckptd restore --job J --rank R [--step S] --to DIR``: fetches every chunk of
    rank ``rank``'s manifest of a committed step (the latest by default) from this
    host's staging pool, peers or the store, verifies each, and writes it into
    the local directory store ``DIR`` with the manifest, the commit record and a
    ``latest`` ref, so that a restore can use ``DIR`` as its cache tier
    (``cache_dir=DIR``) or read ``file://DIR`` directly. Chunks already in ``DIR``
    are verified and kept. A rich progress bar shows bytes as they arrive."""
    from .pipeline import EventLoopThread

    check_job(job)
    rank = int(rank)
    if rank < 0:
        raise InvalidRequest(f"rank {rank} is negative")
    root = Path(to)
    loop = EventLoopThread("ckptd-restore")
    try:
        return loop.run(_prefetch(url, token, job, rank, root, step, local, peers, progress,
                                  console), timeout)
    finally:
        loop.stop()


async def _prefetch(
    url: str, token: str | None, job: str, rank: int, root: Path, step: int | None,
    local: bool, peers: bool, show: bool, console: Any | None,
) -> PrefetchResult:
    from ckptd.repository import Repository
    from ckptd.store.local import LocalStore

    from .transport import open_transport

    t0 = time.perf_counter()
    transport = open_transport(url, token, job=job)
    # Only the repository writes a store (in the documented order); fsync off: a
    # prefetched cache is rebuilt, not recovered, after a crash.
    target = Repository(LocalStore(root, fsync=False))
    try:
        plan = await load_plan(transport, job, rank, step, with_peers=peers)
        check_rank(rank, plan.world_size, job=job)
        manifest = plan.manifest
        sizes: dict[str, int] = {}
        for e in manifest.entries:
            for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, manifest.chunk_size),
                                   strict=True):
                sizes.setdefault(cid, b - a)
        opts = RestoreOptions(local=local, peers=peers, token=token, cache_dir=root)
        entries = [(e, manifest.chunk_size) for e in manifest.entries]
        sources, pool = make_sources(transport, plan, entries, opts, rank)
        fetcher = ChunkFetcher(sources)
        total = sum(sizes.values())
        bar, task = _progress(show, console, f"{job} step {plan.step} rank {rank}", total)
        done = {"bytes": 0}
        budget = asyncio.Semaphore(fetcher.concurrency)

        async def one(cid: str) -> None:
            async with budget:
                buf = bytearray(sizes[cid])
                tier = await fetcher.fetch(cid, memoryview(buf))
                if tier is not None and tier != "cache":
                    await target.put_chunk(cid, memoryview(buf), digest=cid)  # verified on arrival
                done["bytes"] += sizes[cid]
                if bar is not None:
                    bar.update(task, completed=done["bytes"])

        try:
            if bar is not None:
                bar.start()
            await asyncio.gather(*(one(cid) for cid in sizes))
        finally:
            if bar is not None:
                bar.stop()
            for s in sources:
                s.close()
                if isinstance(s, PeerSource):
                    s.client.close()
        if fetcher.failed:
            wanted = _Wanted()
            for e in manifest.entries:
                for cid in e.chunks:
                    wanted.names.setdefault(cid, set()).add(e.name)
            raise failure(fetcher, wanted, plan.step)
        # The documents, as committed: the manifest, the commit record, the ref.
        await target.import_step(plan.record, [manifest])
        return PrefetchResult(
            job=job, rank=rank, step=plan.step, directory=str(root), chunks=len(sizes),
            bytes=total, seconds=time.perf_counter() - t0,
            bytes_from=dict(fetcher.bytes_from), problems=list(fetcher.problems),
        )
    finally:
        await transport.close()
        await target.close()


def _progress(show: bool, console: Any | None, label: str, total: int) -> tuple[Any, Any]:
    if not show:
        return None, None
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    kwargs = {"console": console} if console is not None else {}
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), **kwargs)
    task = bar.add_task(label, total=total)
    return bar, task


__all__ = [
    "TIERS",
    "ChunkFetcher",
    "ChunkProblem",
    "DirectoryCacheSource",
    "LocalPoolSource",
    "LocalStoreSource",
    "PeerSource",
    "PrefetchResult",
    "RestoreLayout",
    "RestoreOptions",
    "RestorePlan",
    "RestoreResult",
    "Source",
    "StoreSource",
    "adopt_pool",
    "build_layout",
    "fetch_layout",
    "load_all_manifests",
    "load_plan",
    "needed_boxes",
    "restore_command",
    "restore_into",
]
