"""Garbage collection of chunks: mark what any manifest names, sweep the rest.

The protocol, and why it is safe while saves run on any number of servers, is in
docs/FORMAT.md ("Garbage collection") and docs/design/006-gc.md. In short:

1. take the store's GC lease (``gc/state``: idle -> marking, generation + 1);
2. list the chunks: only these can be deleted (a chunk written later cannot);
3. wait out the grace period (a save told "present" before the mark began puts
   its manifest within it), and read every rank manifest, committed or pending;
4. move to ``sweeping``: from here on writes wait before they check presence;
5. read the touched ids of this generation and re-read the manifests that
   appeared or are pending; what none of them names is deleted, in batches,
   each only while the lease is safely held;
6. back to idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptd import large_json
from ckptd.documents import document_work
from ckptd.errors import CkptdError, GcInProgress, InvalidDocument, InvalidRequest, NotFound
from ckptd.format import RankManifest
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState, GcTouched, touched_prefix
from ckptd.lifecycle.fence import read_state, sweeping
from ckptd.store.base import Store

log = logging.getLogger(__name__)

_CHUNK_KEY = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})$")
_MANIFEST_KEY = re.compile(r"^jobs/([^/]+)/steps/(\d+)/ranks/\d+\.json$")
_COMMIT_KEY = re.compile(r"^jobs/([^/]+)/steps/(\d+)/commit\.json$")
_DELETE_BATCH = 256
_DELETE_CONCURRENCY = 16
_READ_CONCURRENCY = 16


def _lease_lost(generation: int, why: str) -> GcInProgress:
    """This collector no longer holds the GC lease (it expired, another took it)."""
    return GcInProgress(f"GC generation {generation} {why}", generation=generation,
                        lease_lost=True)


@dataclass(slots=True)
class GcReport:
    """What a collection did (or, dry, would do)."""

    dry_run: bool
    generation: int = 0
    chunks_total: int = 0
    chunks_kept: int = 0
    chunks_deleted: int = 0
    bytes_total: int = 0
    bytes_freed: int = 0
    manifests_read: int = 0
    touched: int = 0
    seconds: float = 0.0
    deleted: list[str] = field(default_factory=list)


class _Lease:
    """The GC state this collector wrote last, renewed by compare-and-swap."""

    def __init__(self, store: Store, lease_s: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.lease_s = lease_s
        self.clock = clock
        self.holder = uuid.uuid4().hex
        self.state: GcState | None = None
        self._bytes: bytes | None = None

    async def acquire(self) -> GcState:
        current, data = await read_state(self.store)
        now = self.clock()
        if current.phase != "idle" and current.expires_at > now:
            raise GcInProgress(
                f"garbage collection {current.generation} is already {current.phase} "
                f"(until {current.expires_at - now:.0f} s from now)",
                generation=current.generation,
            )
        if current.phase != "idle":
            log.warning("taking over GC generation %d, whose collector stopped while %s",
                        current.generation, current.phase)
        new = GcState(generation=current.generation + 1, phase="marking", holder=self.holder,
                      started_at=now, expires_at=now + self.lease_s)
        if not await self.store.compare_and_swap(GC_STATE_KEY, data, new.canonical()):
            raise GcInProgress("another garbage collection started just now")
        self.state, self._bytes = new, new.canonical()
        return new

    async def move(self, phase: str) -> GcState:
        """Renews the lease, optionally entering another phase; ``gc_in_progress`` if gone."""
        assert self.state is not None
        now = self.clock()
        new = self.state.model_copy(update={"phase": phase, "expires_at": now + self.lease_s})
        data = new.canonical()
        if not await self.store.compare_and_swap(GC_STATE_KEY, self._bytes, data):
            raise _lease_lost(self.state.generation, "lost its lease")
        self.state, self._bytes = new, data
        return new

    async def hold(self) -> None:
        """Renews the lease once a quarter of it is gone; refuses to go on with
        under a quarter left (a paused collector must not delete after its lease
        may have run out: writers then stop waiting for it)."""
        assert self.state is not None
        left = self.state.expires_at - self.clock()
        if left < self.lease_s / 4:
            raise _lease_lost(self.state.generation, "is out of lease time")
        if left < self.lease_s * 3 / 4:
            await self.move(self.state.phase)


async def _chunks(store: Store) -> dict[str, int]:
    """Every chunk id in the store and its size."""
    out: dict[str, int] = {}
    async for info in store.list_info("chunks/"):
        m = _CHUNK_KEY.match(info.key)
        if m and m.group(2).startswith(m.group(1)):
            out[m.group(2)] = info.size
    return out


async def _manifest_keys(store: Store) -> tuple[set[str], set[tuple[str, str]]]:
    """(every rank manifest key, every committed (job, step)) under ``jobs/``."""
    manifests: set[str] = set()
    committed: set[tuple[str, str]] = set()
    async for key in store.list_prefix("jobs/"):
        if _MANIFEST_KEY.match(key):
            manifests.add(key)
        elif m := _COMMIT_KEY.match(key):
            committed.add((m.group(1), m.group(2)))
    return manifests, committed


def _chunk_ids_of(data: bytes) -> set[str]:
    """The chunk ids a rank manifest names (its parse dropped once they are out)."""
    with large_json.collector_paused():
        return set(RankManifest.parse(data).chunk_ids())


async def _read_ids(store: Store, keys: set[str], into: set[str]) -> int:
    """Adds the chunk ids every manifest in ``keys`` names to ``into``."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)

    async def one(key: str) -> None:
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                return  # forgotten since it was listed: it protects nothing now
        try:
            # Off the event loop (a server's /healthz keeps answering while a
            # 100,000-tensor manifest parses), with no collection scanning it.
            into.update(await document_work(_chunk_ids_of, data))
        except InvalidDocument as exc:
            # Its chunks are unknown, so none may be deleted on a guess.
            raise InvalidDocument(
                f"garbage collection stopped: rank manifest {key} does not parse ({exc}); "
                "forget that step, then collect again", key=key,
            ) from None

    await asyncio.gather(*(one(k) for k in keys))
    return len(keys)


def _is_pending(key: str, committed: set[tuple[str, str]]) -> bool:
    m = _MANIFEST_KEY.match(key)
    return m is not None and (m.group(1), m.group(2)) not in committed


async def _touched(store: Store, generation: int) -> set[str]:
    ids: set[str] = set()
    async for key in store.list_prefix(touched_prefix(generation)):
        try:
            ids.update(GcTouched.parse(await store.get(key)).ids)
        except NotFound:
            continue
    return ids


async def collect_garbage(
    store: Store,
    *,
    grace: float,
    lease: float = 60.0,
    dry_run: bool = False,
    clock: Callable[[], float] = time.time,
) -> GcReport:
    """Deletes every chunk that no rank manifest names (or, with ``dry_run``, lists
    them without taking the lease or deleting anything)."""
    if grace < 0:  # a negative grace would sweep chunks of saves still in flight
        raise InvalidRequest(f"grace must be >= 0 seconds, not {grace:g}")
    t0 = time.perf_counter()
    report = GcReport(dry_run=dry_run)
    if dry_run:
        sizes = await _chunks(store)
        keys, _ = await _manifest_keys(store)
        referenced: set[str] = set()
        report.manifests_read = await _read_ids(store, keys, referenced)
        doomed = sorted(set(sizes) - referenced)
        _fill(report, sizes, doomed, t0)
        report.generation = (await read_state(store))[0].generation
        return report

    held = _Lease(store, lease, clock)
    state = await held.acquire()
    report.generation = state.generation
    try:
        sizes = await _chunks(store)
        # The grace period: a save answered "present" before the mark began has
        # put its manifest by now, so the listing below sees it.
        while (left := state.started_at + grace - clock()) > 0:
            await asyncio.sleep(min(left, lease / 8))
            await held.hold()
        keys, committed = await _manifest_keys(store)
        referenced = set()
        report.manifests_read = await _read_ids(store, keys, referenced)
        await held.move("sweeping")
        # From here on no write checks presence. What was answered or put before
        # is visible now: touched ids, and manifests (new ones, and pending ones,
        # which a rollback's timeline may have replaced).
        touched = await _touched(store, state.generation)
        report.touched = len(touched)
        again, committed = await _manifest_keys(store)
        fresh = {k for k in again if k not in keys or _is_pending(k, committed)}
        report.manifests_read += await _read_ids(store, fresh, referenced)
        doomed = sorted(set(sizes) - referenced - touched)
        await _sweep(store, held, doomed)
        _fill(report, sizes, doomed, t0)
        await _forget_touched(store, state.generation)
        await held.move("idle")
    except BaseException as exc:
        if not (isinstance(exc, GcInProgress) and exc.detail.get("lease_lost")):
            # Give the lease back: writers need not wait for it to expire. What was
            # deleted so far was garbage; writers that waited re-check presence.
            with contextlib.suppress(CkptdError):
                await held.move("idle")
        raise
    log.info("GC %d: deleted %d chunks (%d bytes), kept %d, in %.2f s", report.generation,
             report.chunks_deleted, report.bytes_freed, report.chunks_kept, report.seconds)
    return report


def _fill(report: GcReport, sizes: dict[str, int], doomed: list[str], t0: float) -> None:
    report.chunks_total = len(sizes)
    report.bytes_total = sum(sizes.values())
    report.chunks_deleted = len(doomed)
    report.chunks_kept = len(sizes) - len(doomed)
    report.bytes_freed = sum(sizes[c] for c in doomed)
    report.deleted = doomed
    report.seconds = time.perf_counter() - t0


async def _sweep(store: Store, held: _Lease, doomed: list[str]) -> None:
    sem = asyncio.Semaphore(_DELETE_CONCURRENCY)

    async def one(cid: str) -> None:
        async with sem:
            await store.delete(f"chunks/{cid[:2]}/{cid}")

    for i in range(0, len(doomed), _DELETE_BATCH):
        await held.hold()  # never delete on a lease that may have run out
        await asyncio.gather(*(one(c) for c in doomed[i : i + _DELETE_BATCH]))


async def _forget_touched(store: Store, generation: int) -> None:
    """Touched documents of this and earlier generations protect nothing any more."""
    async for key in store.list_prefix("gc/touched/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[2].isdigit() and int(parts[2]) <= generation:
            await store.delete(key)


async def gc_state(store: Store, clock: Callable[[], float] = time.time) -> dict[str, object]:
    """The GC state as plain values, for views."""
    state, _ = await read_state(store)
    return {**state.model_dump(), "sweeping_now": sweeping(state, clock())}
