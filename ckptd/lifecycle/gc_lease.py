"""The collector's side of the store's GC lease (``gc/state``): taking it (over a
dead collector's, or a damaged document), renewing it while it works, and
knowing when it must stop. The protocol: docs/FORMAT.md, "Garbage collection"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable

from ckptd.errors import GcInProgress, InvalidDocument, StoreCorrupt, UnsupportedFormat
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState
from ckptd.lifecycle.fence import held_note, read_state, sweeping
from ckptd.lifecycle.gc_mark import touched_generations
from ckptd.lifecycle.reserve import with_room
from ckptd.store.base import Store

log = logging.getLogger(__name__)


def lease_lost(generation: int, why: str) -> GcInProgress:
    """This collector no longer holds the GC lease (it expired, another took it)."""
    return GcInProgress(f"GC generation {generation} {why}", generation=generation,
                        lease_lost=True)


class Lease:
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
        #: a delete was given up on (timed out, cancelled unanswered), or the fence
        #: of a repair was cut short: the store may still carry a delete out, so the
        #: lease must run out (and its margin) before writers go on
        self.abandoned = False
        #: chunk keys whose delete began and was not answered (cut off by a stop)
        self.unanswered: set[str] = set()

    @property
    def generation(self) -> int:
        return self.state.generation if self.state is not None else 0

    async def _swap(self, expected: bytes | None, new: bytes) -> bool:
        # (a full disk releases the store's reserve: a collection is how space returns;
        # never the walk for temporaries, which could land a renewal after its lease)
        return await with_room(self.store, f"update {GC_STATE_KEY}",
                               lambda: self.store.compare_and_swap(GC_STATE_KEY, expected, new),
                               walk=False)

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
        if current.phase != "idle" and (current.expires_at > now or sweeping(current, now)):
            then = ("run `ckptd gc` again then" if current.expires_at <= now else
                    "run `ckptd gc` again once it ended, or through the server collecting "
                    "(--url http://...) to follow it")
            raise GcInProgress(f"{held_note(current, now)}: {then}",
                               generation=current.generation)
        if current.phase != "idle":
            log.warning("taking over GC generation %d, whose collector stopped while %s",
                        current.generation, current.phase)
        new = GcState(generation=current.generation + 1, phase="marking", holder=self.holder,
                      started_at=now, expires_at=now + self.lease_s)
        if not await self._swap(data, new.canonical()):
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
        generation = max([*found, *await touched_generations(self.store), 0]) + 1
        now = self.clock()
        fence = GcState(generation=generation, phase="sweeping", holder=self.holder,
                        started_at=now, expires_at=now + self.lease_s)
        if not await self._swap(data, fence.canonical()):
            raise GcInProgress("another garbage collection took the damaged GC state over",
                               generation=generation)
        log.warning("GC state %s was damaged; generation %d took it over and waits %g s "
                    "for any collector that held it", GC_STATE_KEY, generation, self.lease_s)
        self.state, self._bytes = fence, fence.canonical()
        try:
            while (left := now + self.lease_s - self.clock()) > 0:
                await asyncio.sleep(min(left, self.lease_s / 8))
                await self.hold()
        except BaseException:
            # Stopped before its fence ran out: a collector that held the damaged
            # state may still be deleting, so the fence stays until it expires.
            self.abandoned = True
            raise
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
        if not await self._swap(self._bytes, data):
            raise lease_lost(self.state.generation, "lost its lease")
        self.state, self._bytes = new, data
        return new

    async def release(self) -> bool:
        """Hands the lease back (``idle``); True if it did. From the bytes the store
        holds, when they are still this collector's (its holder id, its generation):
        a renewal cut off by a stop may have landed without this collector knowing
        its bytes. (The caller knows that no delete of its own can still land.)"""
        if self.state is None:
            return False
        for _ in range(3):  # (a renewal of ours may land between the read and the swap)
            try:
                current, data = await read_state(self.store)
            except StoreCorrupt:
                return False
            if (current.holder != self.holder or current.generation != self.state.generation
                    or current.phase == "idle"):
                return False  # another collector's now (it took an expired lease over)
            now = self.clock()
            new = current.model_copy(update={"phase": "idle", "started_at": now,
                                             "expires_at": now + self.lease_s})
            if await self._swap(data, new.canonical()):
                self.state, self._bytes = new, new.canonical()
                return True
        return False

    async def hold(self) -> float:
        """Renews the lease once a quarter of it is gone; refuses to go on with
        under a quarter left (a paused collector must not delete after its lease
        may have run out: writers then stop waiting for it). Returns how long work
        that must end within the lease may take: until a quarter before it ends."""
        assert self.state is not None
        async with self._renewal:
            left = self.state.expires_at - self.clock()
            if left < self.lease_s / 4:
                raise lease_lost(self.state.generation, "is out of lease time")
            if left < self.lease_s * 3 / 4:
                await self._move(self.state.phase)
            return self.state.expires_at - self.clock() - self.lease_s / 4
