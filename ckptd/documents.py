"""Documents off the event loop: the one document thread that parses, checks and
encodes them, and the cache of parsed rank manifests a repository keeps for the
commit and the restore plans that read them again (docs/design/010)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ckptd import large_json
from ckptd.errors import InvalidRequest, StoreCorrupt, UnsupportedFormat, UnsupportedStoredFormat
from ckptd.format import FORMAT_VERSION, RankManifest

_Doc = TypeVar("_Doc")


def parse_stored(parse: Callable[[bytes], _Doc], data: bytes, key: str) -> _Doc:
    """A document read from the store, parsed: one that does not parse is store
    damage (``StoreCorrupt`` naming the key, a 5xx), not the caller's bad input;
    one of a format version this ckptd does not know is ``UnsupportedStoredFormat``
    naming the key (a newer ckptd wrote it: not damage, never to be replaced, and
    not the caller's mistake either: a 5xx, where a sent document's is a 400)."""
    try:
        return parse(data)
    except UnsupportedFormat as exc:
        raise unsupported_stored(exc, key) from None
    except InvalidRequest as exc:
        # Not only InvalidDocument: a field checked as a name (a commit record's job,
        # a tag) says ``invalid_name``, which blamed the caller for the store's damage.
        raise StoreCorrupt(f"damaged document {key}: {exc.message}", key=key) from None


def unsupported_stored(exc: UnsupportedFormat, key: str) -> UnsupportedStoredFormat:
    """``exc`` of a stored document, naming its key and, for a version above this
    ckptd's, what to do."""
    version = exc.detail.get("version")
    newer = type(version) is int and version > FORMAT_VERSION
    hint = "; it was written by a newer ckptd: upgrade ckptd" if newer else ""
    return UnsupportedStoredFormat(f"{key}: {exc.message}{hint}", **{**exc.detail, "key": key})


# One thread parses and validates documents. CPU-bound threads share the GIL with
# the event loop, which waits a switch interval (5 ms) behind each of them: with
# 16 manifests parsing at once, /healthz waited seconds; behind one, milliseconds.
_DOCUMENT_WORKER = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="ckptd-documents"
)

_R = TypeVar("_R")


async def document_work(fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """Runs CPU work on documents (parse, validate, encode) off the event loop, on
    the one document thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_DOCUMENT_WORKER, functools.partial(fn, *args, **kwargs))


async def kept_document_work(fn: Callable[..., _R], *args: Any) -> _R:
    """``document_work`` for documents a server keeps (parsed manifests): built
    with the cyclic collector paused, then frozen out of its scans
    (``large_json.documents_kept_from_collector``)."""

    def kept() -> _R:
        with large_json.documents_kept_from_collector():
            return fn(*args)

    return await document_work(kept)


# Tensor entries of parsed manifests kept for the commit and restore plans that
# read them again (a 100,000-tensor manifest parses in about a second).
MANIFEST_CACHE_ENTRIES = 1_000_000
# And manifests: small ones cost 20-40 KiB each whatever their entries, so a cap
# on entries alone let a server keep every manifest of every step it ever took,
# forgotten ones included (+45 MiB an hour in bench/soak.py, 4 ranks every 4 s).
# A commit and the restore plans of its step read the step's manifests again: this
# many covers both for 500 ranks (a larger job parses its small manifests again,
# cheaply; large ones are capped by their memory, below).
MANIFEST_CACHE_MANIFESTS = 1024
# And by their memory, estimated (``manifest_cost``): within the caps above alone,
# 1024 manifests of 64 MiB (entries of a thousand chunk ids, 190 KiB each) held
# 180 - 250 GiB, and a million one-chunk entries 2.2 - 3.1 GiB. This keeps the
# commit and the restore plans of a step for 500 ranks (1024 manifests) of up to
# 1 MiB each: about 400 entries of one chunk with short names. A larger job parses
# its manifests again (bench/commit_scale.py's 64 ranks of 2,000 entries cost
# 300 MiB, one of 200,000 entries 480 MiB). ``CKPTD_MANIFEST_CACHE_BYTES`` sets it.
MANIFEST_CACHE_BYTES = 1 << 30
# What a cached manifest costs, measured with tracemalloc (RSS is within ~10 % of
# it): per byte of its JSON, the bytes kept for the hit check and the parsed
# strings (a chunk id of 67 bytes of JSON is a 121-byte str in its list); per
# entry, its objects (the model, its dict and field set, its lists, its tree
# node: 1.6 KiB); per manifest, its head. A short-named one-chunk entry (258
# bytes of JSON) measured 2.3 KiB, estimated 2.3; a long-named one of 64 chunks
# (4.7 KiB) 14.4, estimated 15.4; one of 1024 chunks (67 KiB) 190, estimated 203.
MANIFEST_COST_PER_BYTE = 3
MANIFEST_COST_PER_ENTRY = 1600
MANIFEST_COST_PER_MANIFEST = 4096
# Manifests of this many bytes and more are parsed with the collector paused and
# frozen once kept (about 10,000 tensor entries); smaller ones as any object, and
# frozen in batches, once this many of their entries were parsed since the last
# batch: the collection before each freeze holds the GIL about 50 - 90 ms on the
# 2-core CI host with 16 PUTs of 2,000 entries under way (10,000 entries: 100 -
# 135 ms), where left to the collector a 64-rank step's cache took 0.4 s a pass.
KEEP_FROZEN_FROM = 4 * 1024 * 1024
FREEZE_EVERY_ENTRIES = 4_000


def _parse_and_hash(data: bytes) -> RankManifest:
    # One job on the document thread: a second one for the digest waited behind
    # every manifest parsing meanwhile.
    manifest = RankManifest.parse(data)
    manifest.digest()
    return manifest


def manifest_cost(data: bytes, manifest: RankManifest) -> int:
    """The memory a cached manifest holds, estimated from its bytes and entries."""
    return (MANIFEST_COST_PER_BYTE * len(data) + MANIFEST_COST_PER_ENTRY * len(manifest.entries)
            + MANIFEST_COST_PER_MANIFEST)


def _parse_kept(parse: Callable[[bytes], RankManifest], data: bytes, key: str
                ) -> tuple[RankManifest, bytes]:
    """``parse_stored``, and the bytes to keep with the manifest: its own encoding
    when it is ``data`` over again (a manifest parsed without the digest a commit
    names encodes itself and holds that copy: kept with ``data``, the cache held
    both)."""
    manifest = parse_stored(parse, data, key)
    encoded = manifest.canonical()  # (encoded by the parse's check)
    return manifest, encoded if encoded == data else data


class ParsedManifests:
    """Parsed rank manifests by store key, each with the bytes it was parsed from:
    a hit needs the same bytes (a memcmp), so a changed object is parsed afresh.
    Bounded by entries, manifests and their estimated memory (``manifest_cost``);
    the newest manifest stays, whatever it costs."""

    def __init__(self, max_entries: int, max_manifests: int = MANIFEST_CACHE_MANIFESTS,
                 max_bytes: int = MANIFEST_CACHE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_manifests = max_manifests
        self.max_bytes = max_bytes
        #: parse with the collector paused and freeze the result (a server's choice:
        #: see large_json; a training process keeps its collector as it is)
        self.kept_from_collector = False
        self._held: OrderedDict[str, tuple[bytes, RankManifest]] = OrderedDict()
        self._entries = 0
        self._bytes = 0  # their estimated cost
        self._unfrozen = 0  # entries held that were built with the collector running
        self._lock = threading.Lock()

    def get(self, key: str, data: bytes) -> RankManifest | None:
        with self._lock:
            held = self._held.get(key)
            if held is None or held[0] != data:
                return None
            self._held.move_to_end(key)
            return held[1]

    def put(self, key: str, data: bytes, manifest: RankManifest) -> None:
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._entries -= len(old[1].entries)
                self._bytes -= manifest_cost(*old)
            self._held[key] = (data, manifest)
            self._entries += len(manifest.entries)
            self._bytes += manifest_cost(data, manifest)
            while len(self._held) > 1 and (self._entries > self.max_entries
                                           or len(self._held) > self.max_manifests
                                           or self._bytes > self.max_bytes):
                _, dropped = self._held.popitem(last=False)
                self._entries -= len(dropped[1].entries)
                self._bytes -= manifest_cost(*dropped)

    def _parsed(self, data: bytes, manifest: RankManifest) -> None:
        """Counts a manifest parsed with the collector running, and freezes a batch
        of them once due: counted as parsed, not as cached, since a PUT holds its
        manifest unfrozen through its store write (16 at a time doubled the
        collector's passes)."""
        if not self.kept_from_collector or len(data) >= KEEP_FROZEN_FROM:
            return  # (a large one is frozen as it is built)
        with self._lock:
            self._unfrozen += len(manifest.entries)
            if self._unfrozen < FREEZE_EVERY_ENTRIES:
                return
            self._unfrozen = 0
        # Here and now (a batch, not the cache: tens of milliseconds): behind the
        # documents queued on the document thread it came after dozens more.
        large_json.freeze_what_survives()

    async def parse(self, key: str, data: bytes, committed: str | None = None
                    ) -> RankManifest:
        """The manifest in ``data`` (stored at ``key``), parsed off the event loop
        (``committed``: as ``RankManifest.parse`` takes it)."""
        held = self.get(key, data)
        if held is not None:
            return held
        work = self._work(data)
        parse = functools.partial(RankManifest.parse, committed=committed)
        parsed: tuple[RankManifest, bytes] = await work(_parse_kept, parse, data, key)
        manifest, kept = parsed
        self.put(key, kept, manifest)
        self._parsed(data, manifest)
        return manifest

    async def parse_put(self, data: bytes) -> RankManifest:
        """A manifest a client puts, parsed and checked off the event loop
        (``InvalidDocument`` for a bad one: the caller's mistake, not the store's)."""
        manifest: RankManifest = await self._work(data)(_parse_and_hash, data)
        self._parsed(data, manifest)
        return manifest

    def _work(self, data: bytes) -> Callable[..., Awaitable[Any]]:
        # Only large documents are built with the collector paused: a freeze also
        # freezes every object alive then (open connections, requests under way),
        # and those that die in a cycle later are collected only at a compaction.
        # Small ones are frozen in batches (``_parsed``): the collector's own full
        # passes grow rarer as what it holds grows, but each one longer.
        if self.kept_from_collector and len(data) >= KEEP_FROZEN_FROM:
            return kept_document_work
        return document_work
