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
6. back to idle; stale temporaries go, and a local store's space reserve is made
   again (``reserve``).

A collection stopped on purpose (Ctrl-C, SIGTERM, a server's shutdown) hands its
lease back once no delete it began can still land: writers need not wait out the
lease of a collector that is gone. Modules: ``gc_lease`` (the lease), ``gc_mark``
(what the manifests name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import CkptdError, InvalidRequest, StoreCorrupt, UnsupportedStoredFormat
from ckptd.lifecycle.documents import GC_STATE_KEY
from ckptd.lifecycle.fence import held_note, live_until, read_state, sweeping
from ckptd.lifecycle.gc_lease import Lease, lease_lost
from ckptd.lifecycle.gc_mark import (
    _CHUNK_KEY,
    chunks,
    is_pending,
    manifest_keys,
    mark,
    read_ids,
    touched,
)
from ckptd.lifecycle.housekeeping import remove_stale_temporaries, stale_after
from ckptd.lifecycle.reserve import keep_reserve
from ckptd.store.base import Store
from ckptd.store.local import LocalStore
from ckptd.store.memory import MemoryStore

__all__ = ["MAX_GRACE", "GcProgress", "GcReport", "check_grace", "collect_garbage",
           "direct_lease", "gc_state", "_CHUNK_KEY", "_Lease"]

_Lease = Lease  # (its name before the lease had a module of its own)

log = logging.getLogger(__name__)

_DELETE_BATCH = 256
_DELETE_CONCURRENCY = 16
#: how long a stopped sweep waits to see each delete it began land (a local store's
#: unlink, already under way in a thread, takes milliseconds), and to delete again
_SETTLE_S = 0.5

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


def direct_lease(store: Store) -> float:
    """The lease of a collection run on a store directly (``ckptd gc --url DIR``): a
    server's default (``CKPTD_GC_LEASE``, 60 s), on every store. A collector killed
    mid-sweep holds writers for up to two leases; a shorter one on a local directory
    would free them sooner, but a collector that repairs a damaged GC state fences
    writers for its own lease, counting on every collector of the store having one
    lease length: a direct one of 30 s repairing a state a server's collector of 60 s
    was sweeping let writers in while that collector could still delete."""
    return 60.0


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


@dataclass(slots=True)
class GcProgress:
    """Where a collection stands, for whoever stopped it: its generation and phase,
    the chunks deleted so far, and whether it handed its lease back (else writers
    wait for it until ``live_until``)."""

    generation: int = 0
    phase: str = "starting"
    deleted: int = 0
    released: bool = False
    unanswered: bool = False  # a delete cut off that the store may still carry out
    live_until: float | None = None


async def collect_garbage(
    store: Store,
    *,
    grace: float,
    lease: float = 60.0,
    dry_run: bool = False,
    clock: Callable[[], float] = time.time,
    progress: GcProgress | None = None,
) -> GcReport:
    """Deletes every chunk that no rank manifest names (or, with ``dry_run``, lists
    them without taking the lease or deleting anything)."""
    # A negative grace would sweep chunks of saves still in flight; an endless one
    # would hold the lease for ever.
    check_grace(grace)
    t0 = time.perf_counter()
    report = GcReport(dry_run=dry_run)
    at = progress if progress is not None else GcProgress()
    if dry_run:
        sizes = await chunks(store)
        keys, committed = await manifest_keys(store)
        referenced: set[str] = set()
        report.manifests_read = len(await mark(store, keys, committed, referenced))
        doomed = sorted(set(sizes) - referenced)
        _fill(report, sizes, doomed, t0)
        try:
            report.generation = (await read_state(store))[0].generation
        except StoreCorrupt as exc:  # the next real run rewrites it (gc_state says so)
            if exc.detail.get("key") != GC_STATE_KEY:
                raise
        return report

    held = Lease(store, lease, clock)
    try:
        state = await held.acquire()
    except BaseException:
        await _shielded(_wind_down(store, held, at))
        raise
    report.generation = at.generation = state.generation
    try:
        at.phase = "listing"
        async with held.renewing():  # millions of chunks take minutes to list
            sizes = await chunks(store)
        # The grace period: a save answered "present" before the mark began has
        # put its manifest by now, so the listing below sees it.
        at.phase = "waiting out the grace period"
        while (left := state.started_at + grace - clock()) > 0:
            await asyncio.sleep(min(left, lease / 8))
            await held.hold()
        at.phase = "marking"
        keys, committed = await manifest_keys(store)
        referenced = set()
        ids: set[str] = set()
        seen: set[str] = set()
        async with held.renewing():
            keys = await mark(store, keys, committed, referenced)
            report.manifests_read = len(keys)
            # The touched documents so far, read while writers run: the sweep then
            # reads only those written since.
            await touched(store, state.generation, ids, seen)
        await held.move("sweeping")
        at.phase = "sweeping"
        # From here on no write checks presence. What was answered or put before
        # is visible now: touched ids, and manifests (new ones, and pending ones,
        # which a rollback's timeline may have replaced). Writers wait meanwhile.
        async with held.renewing():
            await touched(store, state.generation, ids, seen)
            report.touched = len(ids)
            again, committed = await manifest_keys(store)
            fresh = {k for k in again if k not in keys or is_pending(k, committed)}
            report.manifests_read += await read_ids(store, fresh, referenced)
        doomed = sorted(set(sizes) - referenced - ids)
        await _sweep(store, held, doomed, at)
        _fill(report, sizes, doomed, t0)
        await held.move("idle")
        at.phase, at.released = "done", True
        # Only this generation's sweep read them: writers need not wait for this.
        await _forget_touched(store, state.generation)
    except BaseException:
        # (shielded: a stop may cancel this task twice, and the wind-down decides
        # whether writers wait out the lease)
        await _shielded(_wind_down(store, held, at))
        raise
    await _tidy(store)
    log.info("GC %d: deleted %d chunks (%d bytes), kept %d, in %.2f s", report.generation,
             report.chunks_deleted, report.bytes_freed, report.chunks_kept, report.seconds)
    return report


async def _wind_down(store: Store, held: Lease, at: GcProgress) -> None:
    """A collection that stopped (an error, a lease lost, Ctrl-C, a shutdown) gives
    its lease back, so writers need not wait for it to expire. What was deleted so
    far was garbage, and writers that waited check presence again. Not while a
    delete it began may still land: a delete cut off unanswered (a thread's unlink
    goes on; a request sent may be carried out) counts as landed once its chunk is
    seen gone, else the lease runs out, as after a delete given up on."""
    if at.released:
        return  # (idle already: what failed came after the sweep)
    if held.unanswered and not held.abandoned:
        held.abandoned = True
        held.abandoned = not await _landed(store, held)
    if not held.abandoned:
        with contextlib.suppress(CkptdError, OSError):
            at.released = await held.release()
    at.unanswered = held.abandoned
    if not at.released and held.state is not None and held.state.phase != "idle":
        at.live_until = live_until(held.state)


async def _shielded(work: Coroutine[Any, Any, None]) -> None:
    """Runs ``work`` to its end even if this task is cancelled meanwhile (a few times)."""
    task = asyncio.ensure_future(work)
    for _ in range(4):
        try:
            await asyncio.shield(task)
            return
        except asyncio.CancelledError:
            if task.done():
                return


async def _tidy(store: Store) -> None:
    """After a collection: a killed writer's temporaries go (docs/FORMAT.md, "Store
    layout"), and a local store's space reserve is made again if it was released."""
    try:
        await remove_stale_temporaries(store, max_upload_s=stale_after())
        await keep_reserve(store)
    except (CkptdError, OSError) as exc:  # the collection itself went well
        log.warning("after the collection: %s", exc)


def _fill(report: GcReport, sizes: dict[str, int], doomed: list[str], t0: float) -> None:
    report.chunks_total = len(sizes)
    report.bytes_total = sum(sizes.values())
    report.chunks_deleted = len(doomed)
    report.chunks_kept = len(sizes) - len(doomed)
    report.bytes_freed = sum(sizes[c] for c in doomed)
    report.deleted = doomed
    report.seconds = time.perf_counter() - t0


async def _sweep(store: Store, held: Lease, doomed: list[str], at: GcProgress) -> None:
    sem = asyncio.Semaphore(_DELETE_CONCURRENCY)
    failed: list[Exception] = []
    unanswered = held.unanswered  # deletes begun and not answered (cut off by a stop)

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
                unanswered.add(key)
                try:
                    await asyncio.wait_for(store.delete(key), budget)
                except TimeoutError:
                    held.abandoned = True
                    raise lease_lost(held.generation, f"stopped: deleting {key} took over "
                                     f"{budget:.1f} s, too close to the end of its lease"
                                     ) from None
                unanswered.discard(key)
                at.deleted += 1
            except KeyboardInterrupt:
                # A SIGTERM's interrupt raised in the delete's own task (ckptd/__main__.py
                # raises one where asyncio.run has no Ctrl-C handler of its own: a
                # command started with SIGINT ignored, as `cmd &` in a script is) left
                # the loop once; raised again here it would end the loop's shutdown
                # before this collection's wind-down ran.
                raise asyncio.CancelledError() from None
            except Exception as exc:  # the first failure stops the sweep; raised below
                unanswered.discard(key)  # (answered: a failure, or given up above)
                failed.append(exc)

    for i in range(0, len(doomed), _DELETE_BATCH):
        await asyncio.gather(*(one(c) for c in doomed[i : i + _DELETE_BATCH]))
        if failed:
            raise failed[0]


async def _landed(store: Store, held: Lease) -> bool:
    """Whether every delete the sweep began and did not see answered has landed: its
    chunk is seen gone, or, on a local store, deleted again under the lease (a cut
    off delete there is an unlink in this process's threads: it ran, runs now for
    milliseconds, or, still queued when cut off, never will). Elsewhere a request
    sent may still be carried out: the lease runs out instead."""
    left = sorted(held.unanswered)
    deadline = time.monotonic() + _SETTLE_S
    while left:
        present = await store.exists_many(left)
        left = [k for k, there in zip(left, present, strict=True) if there]
        if not left or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.02)
    if left and isinstance(store, LocalStore | MemoryStore):
        with contextlib.suppress(CkptdError, OSError, TimeoutError):
            budget = min(_SETTLE_S, await held.hold())
            await asyncio.wait_for(asyncio.gather(*(store.delete(k) for k in left)), budget)
            left = []
    if left:
        log.warning("stopped while %d chunk deletes were unanswered: the GC lease runs out "
                    "rather than being handed back", len(left))
    return not left


async def _forget_touched(store: Store, generation: int) -> None:
    """Touched documents of this and earlier generations protect nothing any more."""
    async for key in store.list_prefix("gc/touched/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[2].isdigit() and int(parts[2]) <= generation:
            await store.delete(key)


async def gc_state(store: Store, clock: Callable[[], float] = time.time) -> dict[str, object]:
    """The GC state as plain values, for views: ``note`` says what a held lease (a
    collection under way, or one whose collector stopped) or a damaged state means."""
    now = clock()
    try:
        state, _ = await read_state(store)
    except (StoreCorrupt, UnsupportedStoredFormat) as exc:
        if exc.detail.get("key") != GC_STATE_KEY:
            raise
        # (GET /v1/gc answered 500 here, while every save failed over it; for a
        # damaged one, the status read of `ckptd gc`, which repairs it, failed too)
        damaged = isinstance(exc, StoreCorrupt)
        return {"phase": "damaged" if damaged else "unsupported", "generation": None,
                "sweeping_now": None,
                "note": exc.message + ("; a collection takes it over (it holds saves one "
                                       "lease first, in case a collector was sweeping)"
                                       if damaged else ": this ckptd's saves and collections "
                                       "fail until every server and client of the store is "
                                       "upgraded")}
    out: dict[str, object] = {**state.model_dump(), "sweeping_now": sweeping(state, now)}
    if state.phase != "idle":
        out["live_until"] = live_until(state)
        out["collector_stopped"] = state.expires_at <= now
        out["note"] = held_note(state, now)
    return out
