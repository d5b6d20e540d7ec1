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
from ckptd.errors import InvalidDocument, StoreCorrupt, UnsupportedFormat, UnsupportedStoredFormat
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
    except InvalidDocument as exc:
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
# cheaply; large ones are capped by their entries).
MANIFEST_CACHE_MANIFESTS = 1024
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


class ParsedManifests:
    """Parsed rank manifests by store key, each with the bytes it was parsed from:
    a hit needs the same bytes (a memcmp), so a changed object is parsed afresh."""

    def __init__(self, max_entries: int, max_manifests: int = MANIFEST_CACHE_MANIFESTS
                 ) -> None:
        self.max_entries = max_entries
        self.max_manifests = max_manifests
        #: parse with the collector paused and freeze the result (a server's choice:
        #: see large_json; a training process keeps its collector as it is)
        self.kept_from_collector = False
        self._held: OrderedDict[str, tuple[bytes, RankManifest]] = OrderedDict()
        self._entries = 0
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
            self._held[key] = (data, manifest)
            self._entries += len(manifest.entries)
            while len(self._held) > 1 and (self._entries > self.max_entries
                                           or len(self._held) > self.max_manifests):
                _, (_, dropped) = self._held.popitem(last=False)
                self._entries -= len(dropped.entries)

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
        manifest: RankManifest = await work(parse_stored, parse, data, key)
        self.put(key, data, manifest)
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
