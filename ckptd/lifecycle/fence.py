"""The commit side of the GC protocol (docs/FORMAT.md, "Garbage collection").

A sweep deletes only chunks that no manifest listed after it entered the
``sweeping`` phase names, and that no missing-chunks call answered while it was
``marking``. So the write path needs two things from the store's GC state:

- commits, manifest puts and missing-chunks calls do not check chunk presence
  while a sweep runs (they wait for it, bounded), and
- a missing-chunks call that answered while a collection was marking records
  the ids it answered for that collection, and answers conservatively (present
  ids as missing, so they are sent again) when the GC state changed during it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from ckptd.documents import parse_stored
from ckptd.errors import GcInProgress, NotFound, StoreCorrupt
from ckptd.lifecycle.documents import GC_STATE_KEY, IDLE, GcState, GcTouched, touched_prefix
from ckptd.store.base import Store

log = logging.getLogger(__name__)

#: how long a write waits for a sweep to end before answering ``gc_in_progress``
SWEEP_WAIT_S = 120.0
_POLL_S = 0.05
#: a write that waits this long for a live sweep says so (a sweep's wait is short)
_SAY_AFTER_S = 2.0
#: one line per collection a process waits for, at most this often
_SAY_EVERY_S = 30.0
_said: dict[tuple[int, bool], float] = {}


async def read_state(store: Store) -> tuple[GcState, bytes | None]:
    """The GC state and its stored bytes (None: never collected).

    A damaged state is ``StoreCorrupt`` naming ``gc/state``, and every write that
    fences on it fails with that until a collection rewrites it: the state cannot
    say whether a sweep is live, and if one is, answering "present" or committing
    could name a chunk it is about to delete. Failing the save loses no chunk; the
    client sends the step again later. (``_Lease.acquire`` takes a damaged state
    over.)"""
    try:
        data = await store.get(GC_STATE_KEY)
    except NotFound:
        return IDLE, None
    try:
        return parse_stored(GcState.parse, data, GC_STATE_KEY), data
    except StoreCorrupt as exc:
        raise StoreCorrupt(f"{exc.message}; saves fail until a garbage collection "
                           "(`ckptd gc`) rewrites it", key=GC_STATE_KEY) from None


def sweep_live_until(state: GcState) -> float:
    """Until when a sweeping state counts as live on a writer's clock: its lease,
    then a margin of ``expires_at - started_at`` (one lease: while sweeping, the
    collector sets ``started_at`` at every renewal, which adds the lease).

    The collector ends every delete before ``expires_at`` on its own clock; the
    margin covers a writer's clock running ahead of the collector's by less than
    that, and a delete the store carries out after the collector gave up on it."""
    return state.expires_at + max(0.0, state.expires_at - state.started_at)


def sweeping(state: GcState, now: float) -> bool:
    """A sweep holds the lease; one expired for longer than its margin is a
    collector that died."""
    return state.phase == "sweeping" and sweep_live_until(state) > now


def live_until(state: GcState) -> float:
    """Until when the collection that holds ``state`` counts as live: a marking one
    until its lease ends, a sweeping one after its margin too."""
    return sweep_live_until(state) if state.phase == "sweeping" else state.expires_at


def _clock_time(t: float) -> str:
    try:
        return time.strftime("%H:%M:%S UTC", time.gmtime(t))
    except (OverflowError, OSError, ValueError):  # (a clock far off: a test's, a bad one)
        return f"Unix time {t:.0f}"


def held_note(state: GcState, now: float) -> str:
    """What a non-idle ``state`` means, in a sentence: which collection, whether its
    collector still renews the lease, and until when it counts as live."""
    until = live_until(state)
    if state.expires_at > now:
        return (f"garbage collection {state.generation} is already {state.phase} (its "
                "collector renews its lease while it works; should it stop, the lease holds "
                f"until {_clock_time(until)}, {until - now:.0f} s from now)")
    if until > now:  # a sweep's margin: its collector stopped renewing the lease
        return (f"garbage collection {state.generation}'s collector stopped renewing its "
                f"lease {now - state.expires_at:.0f} s ago while sweeping (it was stopped "
                f"or cut off): writes wait, and the lease can be taken over, at "
                f"{_clock_time(until)} ({until - now:.0f} s from now)")
    return (f"garbage collection {state.generation}'s collector stopped while "
            f"{state.phase}; the next collection takes its lease over")


def _say_wait(state: GcState, now: float) -> None:
    """Logs, once per collection (and again once its collector stopped renewing),
    what a write waits for and until when: a save held by a sweep says why."""
    stopped = state.expires_at <= now
    key = (state.generation, stopped)
    if now - _said.get(key, -_SAY_EVERY_S) < _SAY_EVERY_S:
        return
    _said[key] = now
    for old in [k for k in _said if k[0] < state.generation - 8]:  # (a long-lived server's)
        del _said[old]
    log.warning("a write waits for the store's garbage collection: %s",
                held_note(state, now).replace(" is already ", " is "))


async def wait_not_sweeping(
    store: Store, *, timeout: float = SWEEP_WAIT_S, clock: Callable[[], float] = time.time
) -> GcState:
    """The GC state once no sweep is running; ``GcInProgress`` after ``timeout``."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        state, _ = await read_state(store)
        now = clock()
        if not sweeping(state, now):
            return state
        if state.expires_at <= now or time.monotonic() - t0 >= _SAY_AFTER_S:
            _say_wait(state, now)
        if time.monotonic() >= deadline:
            raise GcInProgress(
                f"{held_note(state, now).replace(' is already ', ' is ')}; retry after it",
                generation=state.generation, live_until=live_until(state),
            )
        await asyncio.sleep(_POLL_S)


async def unchanged(store: Store, before: GcState) -> bool:
    """True when the store's GC state is still ``before``'s collection and phase."""
    state, _ = await read_state(store)
    return state.same(before)


async def fenced_presence(
    store: Store, ids: Sequence[str], check: Callable[[], Awaitable[list[bool]]]
) -> list[bool]:
    """``check()`` (which ids are present), made safe to act on under a running GC.

    The caller of a missing-chunks call skips sending what is present, so a
    present id must survive until its manifest is in: a collection that is
    marking learns of the ids (a touched document, written before answering); a
    collection that started, or moved on, while we looked gets no promise: the
    answer calls everything missing and the caller sends it again."""
    before = await wait_not_sweeping(store)
    present = await check()
    if before.phase == "marking" and ids:
        doc = GcTouched(generation=before.generation, ids=list(ids)).canonical()
        await store.put_if_absent(f"{touched_prefix(before.generation)}{uuid.uuid4().hex}", doc)
    if not await unchanged(store, before):
        return [False] * len(present)
    return present


#: how often a chunk put starts over when the GC state changes under it
_PUT_TRIES = 10


async def fenced_put(
    store: Store, cid: str, put: Callable[[], Awaitable[bool]]
) -> bool:
    """``put()`` (stores chunk ``cid`` if absent; True when it wrote it), made safe to
    act on under a running GC; True when the chunk was written here.

    A chunk written here is newer than any running collection's listing, so no
    sweep deletes it. One that was stored already may be garbage a collection is
    about to sweep: an upload told "missing" while the GC state changed (the
    missing-chunks call then answers every id missing and records none) would be
    a no-op, and the save's manifest would find the chunk gone. It is kept like a
    present id of a missing-chunks call: put again once no sweep runs (a sweep
    that deleted it meanwhile is past it), recorded as touched while a
    collection marks, and checked against a GC state that changed meanwhile."""
    if await put():
        return True
    for _ in range(_PUT_TRIES):
        before = await wait_not_sweeping(store)
        if await put():
            return True  # a sweep deleted it since: written again, after that sweep
        if before.phase == "marking":
            doc = GcTouched(generation=before.generation, ids=[cid]).canonical()
            await store.put_if_absent(f"{touched_prefix(before.generation)}{uuid.uuid4().hex}",
                                      doc)
        if await unchanged(store, before):
            return False
    state, _ = await read_state(store)
    raise GcInProgress(f"garbage collection {state.generation} kept changing phase while "
                       f"chunk {cid} was put; retry", generation=state.generation)
