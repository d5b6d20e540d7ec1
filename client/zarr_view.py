"""A committed step as a read-only zarr v3 store, read lazily and verified.

``CheckpointStore`` serves the documents of ``ckptd.zarr.hierarchy`` and, for each
zarr chunk key, the bytes the grid (``ckptd.zarr.grid``) says make it, from the
ckptd chunks through the same transport a restore uses (HTTP to a server or a
``file://`` store). Every ckptd chunk is hashed on arrival and compared with its
id; bytes that differ raise ``ChunkHashMismatch`` out of the zarr read that needed
them. Nothing is read before zarr asks: opening a group reads the commit record
and the rank manifests, a slice reads the chunks it overlaps and no others.
No torch: this module needs zarr, numpy and the transport.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import blake3
import zarr
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.sync import sync

from ckptd import knobs
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkSizeMismatch,
    Forbidden,
    InvalidRequest,
    Unauthorized,
)
from ckptd.format import canonical_json, chunk_key
from ckptd.zarr.grid import assemble, needed_chunks
from ckptd.zarr.hierarchy import ArrayNode, Hierarchy, build, join

from .endpoint import cache_root, endpoint
from .reach import token_refusal
from .transport import Transport, missing_job, open_transport, read_step

log = logging.getLogger(__name__)


__all__ = ["CheckpointStore", "open_step"]

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_CONCURRENCY = 8


class CheckpointStore(Store):
    """A committed step of ``job`` (``step=None``: the latest) as a zarr v3 store.

    ``url`` is ``http://host:port`` (a ckptd server, with ``token``) or
    ``file:///path`` (a store directory). ``transport`` replaces ``url`` with an
    open transport. Chunks come from ``cache_dir`` (default ``CKPTD_CACHE_DIR``, a
    local directory store such as ``ckptd restore --to`` fills) when it holds them
    with the right bytes, else from the store. ``fetched`` counts the chunks read
    from the store, ``bytes_from`` the bytes by tier."""

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(
        self,
        url: str,
        job: str,
        step: int | None = None,
        token: str | None = None,
        *,
        transport: Transport | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        super().__init__(read_only=True)
        # The token defaults to CKPTD_TOKEN as the Checkpointer's, Reader's and CLI's do.
        self.url, self.token = endpoint(url, token)
        self.job = job
        self.step = step  # the step asked for; after the first read, the step read
        self._asked = step
        self.fetched = 0  # chunks read from the store (the transport)
        self.fetched_ids: list[str] = []
        self.bytes_from = {"cache": 0, "store": 0}
        # The restore's cache tier: a local directory store (``ckptd restore --to``).
        cache = cache_dir if cache_dir is not None else knobs.cache_dir()
        self.cache_dir = Path(cache_root(cache)) if cache else None
        self._transport = transport
        self._own_transport = transport is None
        self._hierarchy: Hierarchy | None = None
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._concurrency = concurrency
        self._gate: asyncio.Semaphore | None = None
        self._inflight: dict[str, asyncio.Future[bytes]] = {}
        # The reads under way on zarr's loop: cancelled, and waited for, at close.
        self._reading: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self._loading: asyncio.Future[Hierarchy] | None = None

    # -- identity ------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, CheckpointStore)
            and (other.url, other.job, other._asked) == (self.url, self.job, self._asked)
            and (self._own_transport and other._own_transport
                 or other._transport is self._transport)
        )

    def __hash__(self) -> int:
        return hash((self.url, self.job, self._asked))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, {self.job!r}, step={self.step!r})"

    def with_read_only(self, read_only: bool = False) -> CheckpointStore:
        if not read_only:
            raise InvalidRequest("a checkpoint's zarr view is read-only")
        return self

    # -- the step ------------------------------------------------------------------

    async def hierarchy(self) -> Hierarchy:
        """The step's groups and arrays (read once: commit record, manifests)."""
        if self._hierarchy is not None:
            return self._hierarchy
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load())
        try:
            return await asyncio.shield(self._loading)
        except BaseException:
            self._loading = None
            raise

    async def _open(self) -> None:
        # zarr takes any KeyError of its first read for "no group here" (a
        # GroupNotFoundError naming neither job nor step): the step is read as zarr
        # opens the store, outside that, so a job or step not there says so itself.
        await self.hierarchy()
        await super()._open()

    async def _load(self) -> Hierarchy:
        transport = self._open_transport()
        try:
            step, manifests = await read_step(transport, self.job, self.step)
        except CheckpointNotFound as exc:
            raise await missing_job(transport, self.job) or exc from None
        except (Unauthorized, Forbidden) as exc:
            raise token_refusal(exc, self.url, self.token is not None, self.job,
                                needs="read") from None
        self.step = step
        self._hierarchy = build(manifests)
        return self._hierarchy

    def _open_transport(self) -> Transport:
        if self._transport is None:
            self._transport = open_transport(self.url, self.token, job=self.job,
                                             create=False)
        return self._transport

    async def array_node(self, path: str) -> ArrayNode:
        h = await self.hierarchy()
        try:
            return h.arrays[path]
        except KeyError:
            raise InvalidRequest(f"step {self.step} of {self.job} has no array {path!r}") from None

    # -- reads ---------------------------------------------------------------------

    async def get(
        self,
        key: str,
        prototype: BufferPrototype,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        data = await self.get_bytes(key)
        if data is None:
            return None
        return prototype.buffer.from_bytes(_ranged(data, byte_range))

    async def get_bytes(self, key: str) -> bytes | None:
        """The bytes of one key of the view (a document or a zarr chunk), or None."""
        h = await self.hierarchy()
        if key == "zarr.json" or key.endswith("/zarr.json"):
            meta = h.metadata(key[: -len("zarr.json")].rstrip("/"))
            return None if meta is None else canonical_json(meta)
        found = _parse_chunk_key(h, key)
        if found is None:
            return None
        return await self.chunk(*found)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        h = await self.hierarchy()
        if key == "zarr.json" or key.endswith("/zarr.json"):
            return h.metadata(key[: -len("zarr.json")].rstrip("/")) is not None
        return _parse_chunk_key(h, key) is not None

    async def chunk(self, node: ArrayNode, index: tuple[int, ...]) -> bytes | None:
        """Zarr chunk ``index`` of an array: one ckptd chunk as it is where the grid
        is aligned, else assembled from the byte ranges of the ckptd chunks under it."""
        grid = node.grid
        wanted = needed_chunks(grid, index)
        if not wanted and grid.aligned:
            return None
        datas = await asyncio.gather(
            *(self.fetch(grid.boxes[b].chunks[k], node.name) for b, k in wanted)
        )
        return assemble(grid, index, dict(zip(wanted, datas, strict=True)))

    async def fetch(self, cid: str, name: str = "") -> bytes:
        """One ckptd chunk's bytes, verified against its id (cached, fetched once)."""
        task = asyncio.current_task()
        if task is not None:
            self._reading.add(task)
        try:
            return await self._fetch(cid, name)
        finally:
            self._reading.discard(task)  # type: ignore[arg-type]

    async def _fetch(self, cid: str, name: str) -> bytes:
        cached = self._cache.get(cid)
        if cached is not None:
            self._cache.move_to_end(cid)
            return cached
        pending = self._inflight.get(cid)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._inflight[cid] = future
        try:
            data = await self._fetch_verified(cid, name)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning if none waits
            raise
        finally:
            self._inflight.pop(cid, None)
        future.set_result(data)
        self._remember(cid, data)
        return data

    async def _fetch_verified(self, cid: str, name: str) -> bytes:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._concurrency)
        async with self._gate:
            if self.cache_dir is not None:
                cached = await asyncio.to_thread(_read_cached, self.cache_dir, cid)
                if cached is not None:
                    self.bytes_from["cache"] += len(cached)
                    return cached
            data = await self._open_transport().get_chunk(cid)
            actual = await asyncio.to_thread(_hash, data)
        self.fetched += 1
        self.fetched_ids.append(cid)
        self.bytes_from["store"] += len(data)
        if actual != cid:
            raise ChunkHashMismatch(
                f"chunk {cid} of {name!r} (step {self.step} of {self.job}) arrived corrupt",
                id=cid, actual=actual, entries=[name], step=self.step,
            )
        if not data and cid != _EMPTY:
            raise ChunkSizeMismatch(f"chunk {cid} arrived empty", id=cid)
        return data

    def _remember(self, cid: str, data: bytes) -> None:
        if len(data) > self._cache_bytes:
            return
        self._cache[cid] = data
        total = sum(len(d) for d in self._cache.values())
        while total > self._cache_bytes:
            _, old = self._cache.popitem(last=False)
            total -= len(old)

    # -- listing -------------------------------------------------------------------

    async def list(self) -> AsyncIterator[str]:
        h = await self.hierarchy()
        for key in h.store_keys():
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        h = await self.hierarchy()
        for key in h.store_keys():
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        h = await self.hierarchy()
        path = prefix.rstrip("/")
        if path in h.groups:
            yield "zarr.json"
            for name in h.groups[path].children:
                yield name
            return
        if path in h.arrays:
            yield "zarr.json"
            if any(h.arrays[path].grid.counts) or not h.arrays[path].grid.shape:
                yield "c"
            return
        names: set[str] = set()
        start = f"{path}/" if path else ""
        for key in h.store_keys():
            if key.startswith(start):
                names.add(key[len(start) :].split("/", 1)[0])
        for name in sorted(names):
            yield name

    # -- writes: refused -----------------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        raise InvalidRequest("a checkpoint's zarr view is read-only")

    async def delete(self, key: str) -> None:
        raise InvalidRequest("a checkpoint's zarr view is read-only")

    def close(self) -> None:
        # Reads still under way (an export interrupted: Ctrl-C stops the main thread
        # only) end first, on zarr's loop: closed under them, their errors came after
        # zarr's exit hook had stopped that loop, unretrieved, a traceback after the
        # command's one line.
        if any(not t.done() for t in self._reading):
            sync(self._cancel_reads())
        transport, self._transport = self._transport, None
        if transport is not None and self._own_transport:
            sync(transport.close())
        super().close()

    async def _cancel_reads(self) -> None:
        reads = [t for t in self._reading if not t.done()]
        for t in reads:
            t.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        await asyncio.sleep(0)  # (the callbacks of those who waited on them run)


def open_step(
    url: str, job: str, step: int | None = None, token: str | None = None
) -> zarr.Group:
    """The root group of a committed step's zarr view."""
    return zarr.open_group(store=CheckpointStore(url, job, step, token), mode="r")


_EMPTY = blake3.blake3(b"").hexdigest()


def _hash(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _read_cached(root: Path, cid: str) -> bytes | None:
    """A chunk from a local directory store if its bytes are the right ones."""
    try:
        data = (root / chunk_key(cid)).read_bytes()
    except OSError:
        return None
    if _hash(data) != cid:
        log.warning("cache %s has corrupt bytes for chunk %s; reading the store", root, cid)
        return None
    return data


def _ranged(data: bytes, byte_range: ByteRequest | None) -> bytes:
    if byte_range is None:
        return data
    if isinstance(byte_range, RangeByteRequest):
        return data[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return data[byte_range.offset :]
    if isinstance(byte_range, SuffixByteRequest):
        return data[-byte_range.suffix :] if byte_range.suffix else b""
    raise InvalidRequest(f"unknown byte range {byte_range!r}")


def _parse_chunk_key(h: Hierarchy, key: str) -> tuple[ArrayNode, tuple[int, ...]] | None:
    parts = key.split("/")
    for i, part in enumerate(parts):
        if part != "c":
            continue
        node = h.arrays.get("/".join(parts[:i]))
        if node is None:
            continue
        rest = parts[i + 1 :]
        if len(rest) != len(node.grid.shape):
            return None
        try:
            index = tuple(int(p) for p in rest)
        except ValueError:
            return None
        if any(not 0 <= x < n for x, n in zip(index, node.grid.counts, strict=True)):
            return None
        if not node.grid.shape and not node.grid.boxes[0].chunks:
            return None
        return node, index
    return None


def array_path(h: Hierarchy, name: str) -> str:
    """The zarr path of a ckptd entry name."""
    for path, node in h.arrays.items():
        if node.name == name:
            return path
    return join("", name)
