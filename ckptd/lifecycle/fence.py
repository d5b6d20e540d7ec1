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
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from ckptd.documents import parse_stored
from ckptd.errors import GcInProgress, NotFound, StoreCorrupt
from ckptd.lifecycle.documents import GC_STATE_KEY, IDLE, GcState, GcTouched, touched_prefix
from ckptd.store.base import Store

#: how long a write waits for a sweep to end before answering ``gc_in_progress``
SWEEP_WAIT_S = 120.0
_POLL_S = 0.05


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


async def wait_not_sweeping(
    store: Store, *, timeout: float = SWEEP_WAIT_S, clock: Callable[[], float] = time.time
) -> GcState:
    """The GC state once no sweep is running; ``GcInProgress`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        state, _ = await read_state(store)
        if not sweeping(state, clock()):
            return state
        if time.monotonic() >= deadline:
            raise GcInProgress(
                f"garbage collection {state.generation} is sweeping the store; retry",
                generation=state.generation,
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
