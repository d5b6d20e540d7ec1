"""Garbage collection of chunks: mark what any manifest names, sweep the rest.

The protocol, and why it is safe while saves run on any number of servers, is in
docs/FORMAT.md ("Garbage collection") and docs/design/006-gc.md. In short:

1. take the store's GC lease (``gc/state``: idle -> marking, generation + 1);
2. list the chunks: only these can be deleted (a chunk written later cannot);
3. wait out the grace period (a save told "present" before the mark began puts
   its manifest within it), and read every rank manifest, committed or pending,
   and every commit record: a damaged step (a record or manifest unreadable, a
   committed manifest missing or not the bytes its record names) stops it;
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
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ckptd import large_json
from ckptd.documents import document_work, parse_stored, unsupported_stored
from ckptd.errors import (
    CkptdError,
    GcInProgress,
    InvalidDocument,
    InvalidRequest,
    NotFound,
    StoreCorrupt,
    UnsupportedFormat,
)
from ckptd.format import CommitRecord, RankManifest, commit_key, manifest_key, removal_key
from ckptd.hashing import document_hash
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState, GcTouched, touched_prefix
from ckptd.lifecycle.fence import read_state, sweep_live_until, sweeping
from ckptd.store.base import Store

log = logging.getLogger(__name__)

_CHUNK_KEY = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})$")
_MANIFEST_KEY = re.compile(r"^jobs/([^/]+)/steps/(\d+)/ranks/\d+\.json$")
_COMMIT_KEY = re.compile(r"^jobs/([^/]+)/steps/(\d+)/commit\.json$")
_DELETE_BATCH = 256
_DELETE_CONCURRENCY = 16
_READ_CONCURRENCY = 16

#: The longest grace period a collection waits out (7 days): it holds the store's
#: GC lease meanwhile, so an endless one (``inf``) would hold it until a restart.
MAX_GRACE = 7 * 86400.0


def check_grace(grace: float) -> float:
    """``grace`` if it is a grace period a collection can wait out, else
    ``InvalidRequest`` saying what is."""
    # (NaN fails every comparison: the ``not`` refuses it too.)
    if not 0 <= grace <= MAX_GRACE or not math.isfinite(grace):
        raise InvalidRequest(
            f"grace must be from 0 to {MAX_GRACE:.0f} seconds (7 days), not {grace:g}: a "
            "collection holds the store's GC lease while it waits", grace=str(grace),
            max_grace=MAX_GRACE)
    return grace


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
        # One renewal at a time: concurrent deletes each hold() the lease, and two
        # compare-and-swaps from the same bytes would lose it to each other.
        self._renewal = asyncio.Lock()
        #: a delete was given up on (timed out, cancelled): the store may still carry
        #: it out, so the lease must run out (and its margin) before writers go on
        self.abandoned = False

    @property
    def generation(self) -> int:
        return self.state.generation if self.state is not None else 0

    async def acquire(self) -> GcState:
        try:
            current, data = await read_state(self.store)
        except StoreCorrupt as exc:
            if exc.detail.get("key") != GC_STATE_KEY:
                raise
            return await self._repair(exc)
        now = self.clock()
        # A marking collector deletes nothing: once expired it can be taken over (its
        # switch to sweeping would fail its compare-and-swap). A sweeping one may
        # still have deletes in flight: it is dead only after its margin too.
        live_until = (sweep_live_until(current) if current.phase == "sweeping"
                      else current.expires_at)
        if current.phase != "idle" and (current.expires_at > now or sweeping(current, now)):
            raise GcInProgress(
                f"garbage collection {current.generation} is already {current.phase} "
                f"(until {live_until - now:.0f} s from now): run `ckptd gc` again once it "
                "ended, or through the server collecting (--url http://...) to follow it",
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

    async def _repair(self, damage: StoreCorrupt) -> GcState:
        """Takes over a damaged ``gc/state`` (compare-and-swap against its bytes),
        then marks as usual.

        Whether a sweep was live when it was damaged is unknown. One that was stops
        at its next renewal (its compare-and-swap fails) and ends every delete
        within its lease; writers failed meanwhile (``read_state``). So the state
        written first is a sweep of this collector's that deletes nothing: writers
        wait for it one lease (collectors of a store share one lease length), then
        it turns to marking. Its generation is above any left in the damaged bytes
        or in a touched document, so no writer takes it for the one it read."""
        data = await self.store.get(GC_STATE_KEY)
        try:
            GcState.parse(data)
        except UnsupportedFormat:
            raise damage from None  # a newer ckptd's state: not ours to overwrite
        except InvalidDocument:
            pass
        else:  # whole again: another collection took it over since we read it
            raise GcInProgress("another garbage collection took the damaged GC state over")
        found = [int(m) for m in re.findall(rb'"generation":\s*(\d+)', data)]
        generation = max([*found, *await _touched_generations(self.store), 0]) + 1
        now = self.clock()
        fence = GcState(generation=generation, phase="sweeping", holder=self.holder,
                        started_at=now, expires_at=now + self.lease_s)
        if not await self.store.compare_and_swap(GC_STATE_KEY, data, fence.canonical()):
            raise GcInProgress("another garbage collection took the damaged GC state over",
                               generation=generation)
        log.warning("GC state %s was damaged; generation %d took it over and waits %g s "
                    "for any collector that held it", GC_STATE_KEY, generation, self.lease_s)
        self.state, self._bytes = fence, fence.canonical()
        while (left := now + self.lease_s - self.clock()) > 0:
            await asyncio.sleep(min(left, self.lease_s / 8))
            await self.hold()
        return await self.move("marking")

    @contextlib.asynccontextmanager
    async def renewing(self) -> AsyncIterator[None]:
        """Renews the lease in the background while the body reads: writers wait
        for a sweep meanwhile, and a lease run out would stop it for nothing."""
        stop = asyncio.Event()

        async def renew() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.lease_s / 8)
                if not stop.is_set():
                    await self.hold()

        # Stopped, never cancelled: a renewal cut off mid compare-and-swap would
        # leave this collector not knowing its own state's bytes.
        task = asyncio.create_task(renew(), name="ckptd-gc-lease")
        try:
            yield
        finally:
            stop.set()
            renewal = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(renewal, BaseException):
            raise renewal

    async def move(self, phase: str) -> GcState:
        """Renews the lease, optionally entering another phase; ``gc_in_progress`` if gone."""
        async with self._renewal:
            return await self._move(phase)

    async def _move(self, phase: str) -> GcState:
        assert self.state is not None
        now = self.clock()
        update: dict[str, object] = {"phase": phase, "expires_at": now + self.lease_s}
        if phase != self.state.phase or phase == "sweeping":
            # Writers measure a dead sweep's margin as ``expires_at - started_at``:
            # while sweeping, ``started_at`` is the last renewal, so the margin is one
            # lease however long the sweep ran (marking keeps its start: the grace
            # period counts from it).
            update["started_at"] = now
        new = self.state.model_copy(update=update)
        data = new.canonical()
        if not await self.store.compare_and_swap(GC_STATE_KEY, self._bytes, data):
            raise _lease_lost(self.state.generation, "lost its lease")
        self.state, self._bytes = new, data
        return new

    async def hold(self) -> float:
        """Renews the lease once a quarter of it is gone; refuses to go on with
        under a quarter left (a paused collector must not delete after its lease
        may have run out: writers then stop waiting for it). Returns how long work
        that must end within the lease may take: until a quarter before it ends."""
        assert self.state is not None
        async with self._renewal:
            left = self.state.expires_at - self.clock()
            if left < self.lease_s / 4:
                raise _lease_lost(self.state.generation, "is out of lease time")
            if left < self.lease_s * 3 / 4:
                await self._move(self.state.phase)
            return self.state.expires_at - self.clock() - self.lease_s / 4


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


def _committed_ids(data: bytes, expected: str) -> set[str] | None:
    """``_chunk_ids_of`` a committed step's manifest, or None when its bytes are not
    those its commit record names (hashed first: such bytes are not parsed)."""
    return _chunk_ids_of(data) if document_hash(data) == expected else None


def _stopped(key: str, what: str) -> StoreCorrupt:
    """A damaged step stops the collection (docs/operations.md): its chunks are
    unknown, so none may be deleted on a guess. Store damage (a 5xx naming the
    document), not the caller's request."""
    m = _MANIFEST_KEY.match(key) or _COMMIT_KEY.match(key)
    forget = (f"ckptd forget {m.group(1)} --step {m.group(2)}" if m is not None
              else "ckptd forget JOB --step STEP")
    return StoreCorrupt(f"garbage collection stopped: {what}; forget that step ({forget}), "
                        "then collect again", key=key)


@dataclass(frozen=True, slots=True)
class _Committed:
    """What the commit record of a manifest's step says of it."""

    record: str  # the commit record's key
    digest: str  # the hash of the record's bytes as read
    manifest: str  # the hash the record names for this rank's manifest


async def _commit_records(store: Store, committed: set[tuple[str, str]]
                          ) -> dict[str, _Committed]:
    """Manifest key -> what its commit record says, for every rank of every
    committed step: a committed step's manifest that is missing, or not the bytes
    its record names, stops the collection like one that does not parse (its
    chunks may be the only copy of the step, and a manifest put back from a backup
    would name chunks gone). So does a commit record that does not read back."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)
    out: dict[str, _Committed] = {}

    async def one(job: str, step: int) -> None:
        key = commit_key(job, step)
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                return  # forgotten since it was listed
        try:
            record = await document_work(CommitRecord.parse, data)
        except UnsupportedFormat as exc:  # a newer ckptd's: upgrade, never forget it
            raise unsupported_stored(exc, key) from None
        except InvalidRequest as exc:  # (a field checked as a name too: invalid_name)
            raise _stopped(key, f"commit record {key} does not parse ({exc.message})"
                           ) from None
        if record.job != job or record.step != step:  # a record copied to another key
            raise _stopped(key, f"commit record {key} names step {record.step} of "
                           f"{record.job}")
        digest = document_hash(data)
        for ref in record.manifests:
            out[manifest_key(job, step, ref.rank)] = _Committed(key, digest, ref.hash)

    await asyncio.gather(*(one(job, int(step)) for job, step in committed))
    return out


async def _still_committed(store: Store, named: _Committed) -> bool:
    """Whether the record that named a manifest is still there, the same, and no
    retention pass is removing its step: only then is the manifest's absence (or
    other bytes) damage, not a step forgotten, or forgotten and committed anew,
    since the record was read."""
    try:
        data = await store.get(named.record)
    except NotFound:
        return False
    m = _COMMIT_KEY.match(named.record)
    assert m is not None
    return (document_hash(data) == named.digest
            and not await store.exists(removal_key(m.group(1), int(m.group(2)))))


async def _read_ids(store: Store, keys: set[str], into: set[str],
                    named: dict[str, _Committed] | None = None) -> int:
    """Adds the chunk ids every manifest in ``keys`` names to ``into``; ``named``
    (``_commit_records``) says which are committed, and what their bytes must be."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)
    named = named or {}

    async def one(key: str) -> None:
        committed = named.get(key)
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                if committed is not None and await _still_committed(store, committed):
                    raise _stopped(key, f"rank manifest {key}, named by its commit record "
                                   f"{committed.record}, is missing") from None
                return  # forgotten since it was listed: it protects nothing now
        try:
            # Off the event loop (a server's /healthz keeps answering while a
            # 100,000-tensor manifest parses), with no collection scanning it.
            if committed is None:
                ids = await document_work(_chunk_ids_of, data)
            else:
                found = await document_work(_committed_ids, data, committed.manifest)
                if found is None and await _still_committed(store, committed):
                    raise _stopped(key, f"rank manifest {key} is not the document its "
                                   f"commit record {committed.record} names")
                ids = found if found is not None else await document_work(_chunk_ids_of, data)
        except UnsupportedFormat as exc:  # a newer ckptd's save: upgrade, never forget it
            raise unsupported_stored(exc, key) from None
        except InvalidRequest as exc:  # (a field checked as a name too: invalid_name)
            raise _stopped(key, f"rank manifest {key} does not parse ({exc.message})"
                           ) from None
        into.update(ids)

    await asyncio.gather(*(one(k) for k in keys))
    return len(keys)


async def _mark(store: Store, keys: set[str], committed: set[tuple[str, str]],
                into: set[str]) -> set[str]:
    """Reads every listed manifest and every one a commit record names (a manifest
    missing from the listing is read too: it may be damage) into ``into``; returns
    the keys read."""
    named = await _commit_records(store, committed)
    every = keys | set(named)
    await _read_ids(store, every, into, named)
    return every


def _is_pending(key: str, committed: set[tuple[str, str]]) -> bool:
    m = _MANIFEST_KEY.match(key)
    return m is not None and (m.group(1), m.group(2)) not in committed


async def _touched_generations(store: Store) -> list[int]:
    """The generations that have touched documents."""
    return [int(name) for name in await store.list_dir("gc/touched/") if name.isdigit()]


async def _touched(store: Store, generation: int, ids: set[str], seen: set[str]) -> None:
    """Adds to ``ids`` those of the generation's touched documents not in ``seen``
    (each is written once and never changed), read a few at a time."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)
    keys = [k async for k in store.list_prefix(touched_prefix(generation)) if k not in seen]

    async def one(key: str) -> None:
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                return
        ids.update(parse_stored(GcTouched.parse, data, key).ids)
        seen.add(key)

    await asyncio.gather(*(one(k) for k in keys))


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
    # A negative grace would sweep chunks of saves still in flight; an endless one
    # would hold the lease for ever.
    check_grace(grace)
    t0 = time.perf_counter()
    report = GcReport(dry_run=dry_run)
    if dry_run:
        sizes = await _chunks(store)
        keys, committed = await _manifest_keys(store)
        referenced: set[str] = set()
        report.manifests_read = len(await _mark(store, keys, committed, referenced))
        doomed = sorted(set(sizes) - referenced)
        _fill(report, sizes, doomed, t0)
        report.generation = (await read_state(store))[0].generation
        return report

    held = _Lease(store, lease, clock)
    state = await held.acquire()
    report.generation = state.generation
    try:
        async with held.renewing():  # millions of chunks take minutes to list
            sizes = await _chunks(store)
        # The grace period: a save answered "present" before the mark began has
        # put its manifest by now, so the listing below sees it.
        while (left := state.started_at + grace - clock()) > 0:
            await asyncio.sleep(min(left, lease / 8))
            await held.hold()
        keys, committed = await _manifest_keys(store)
        referenced = set()
        touched: set[str] = set()
        seen: set[str] = set()
        async with held.renewing():
            keys = await _mark(store, keys, committed, referenced)
            report.manifests_read = len(keys)
            # The touched documents so far, read while writers run: the sweep then
            # reads only those written since.
            await _touched(store, state.generation, touched, seen)
        await held.move("sweeping")
        # From here on no write checks presence. What was answered or put before
        # is visible now: touched ids, and manifests (new ones, and pending ones,
        # which a rollback's timeline may have replaced). Writers wait meanwhile.
        async with held.renewing():
            await _touched(store, state.generation, touched, seen)
            report.touched = len(touched)
            again, committed = await _manifest_keys(store)
            fresh = {k for k in again if k not in keys or _is_pending(k, committed)}
            report.manifests_read += await _read_ids(store, fresh, referenced)
        doomed = sorted(set(sizes) - referenced - touched)
        await _sweep(store, held, doomed)
        _fill(report, sizes, doomed, t0)
        await held.move("idle")
        # Only this generation's sweep read them: writers need not wait for this.
        await _forget_touched(store, state.generation)
    except BaseException:
        if not held.abandoned:
            # Give the lease back: writers need not wait for it to expire. What was
            # deleted so far was garbage; writers that waited re-check presence.
            # (No delete is under way: the sweep waits for those it began. One lost
            # to another collector fails this compare-and-swap, harmlessly.)
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
    failed: list[Exception] = []

    async def one(cid: str) -> None:
        async with sem:
            if failed:
                return  # start no delete after one failed; let those begun end
            key = f"chunks/{cid[:2]}/{cid}"
            try:
                # Before every delete, not once per batch: one delete can stall (an
                # S3 client retries for minutes), and writers stop waiting for the
                # sweep once its lease is over. So each delete also ends, answered
                # or not, a quarter of the lease before it runs out.
                budget = await held.hold()
                try:
                    await asyncio.wait_for(store.delete(key), budget)
                except TimeoutError:
                    held.abandoned = True
                    raise _lease_lost(held.generation, f"stopped: deleting {key} took over "
                                      f"{budget:.1f} s, too close to the end of its lease"
                                      ) from None
                except asyncio.CancelledError:
                    held.abandoned = True
                    raise
            except Exception as exc:  # the first failure stops the sweep; raised below
                failed.append(exc)

    for i in range(0, len(doomed), _DELETE_BATCH):
        await asyncio.gather(*(one(c) for c in doomed[i : i + _DELETE_BATCH]))
        if failed:
            raise failed[0]


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
