"""Rollback and timeline: their reads, and their writes in their order (the
timeline first, then the marker; docs/design/005-rollback-timelines.md)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from ckptd.documents import parse_stored
from ckptd.errors import (
    Conflict,
    InvalidDocument,
    ManifestNotFound,
    NotFound,
    StoreCorrupt,
    StoreError,
    Superseded,
    UnsupportedFormat,
)
from ckptd.format import (
    CommitRecord,
    Ref,
    Timeline,
    check_job,
    job_prefix,
    manifest_epoch,
    timeline_key,
)
from ckptd.repository.reads import StoredReads
from ckptd.repository.results import RollbackSet

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Timelines(StoredReads):
    """Rollbacks and timelines: the marker that sends a job back to a committed
    step, and the epoch that refuses work saved before it."""

    # Rollbacks of one job, one at a time in this process (``set_rollback``): a lock
    # and its holders and waiters per job, kept only while it has some.
    _rollback_locks: dict[str, tuple[asyncio.Lock, int]]

    @staticmethod
    def _rollback_key(job: str) -> str:
        return f"{job_prefix(job)}refs/rollback"

    @contextlib.asynccontextmanager
    async def _one_rollback_at_a_time(self, job: str) -> AsyncIterator[None]:
        if "_rollback_locks" not in self.__dict__:
            self._rollback_locks = {}
        locks = self._rollback_locks
        lock, users = locks.get(job, (None, 0))
        lock = lock or asyncio.Lock()
        locks[job] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = locks[job]
            if users == 1:
                del locks[job]
            else:
                locks[job] = (lock, users - 1)

    async def step_damage(self, record: CommitRecord) -> tuple[str, str] | None:
        """The damaged document of a committed step (its key, what is wrong), or
        None: the repository's listings know (scrub's markers, its manifests)."""
        return None

    async def read_rollback(self, job: str) -> Ref | None:
        """The job's rollback marker (a Ref to a committed step), or None."""
        try:
            data = await self.store.get(self._rollback_key(job))
        except NotFound:
            return None
        return parse_stored(Ref.parse, data, self._rollback_key(job))

    async def rollback_state(self, job: str) -> tuple[Ref | None, int]:
        """The rollback marker (None when clear) and the job's epoch, as one pair.

        ``set_rollback`` writes the timeline, then the marker: between the two a
        reader sees the new epoch with the previous marker. The timeline holds the
        newest rollback's target, so while a marker is set, that is the answer."""
        timeline = await self.timeline(job)
        marker = await self.read_rollback(job)
        if timeline is None:
            return marker, 0
        if marker is None:
            return None, timeline.epoch
        return Ref(step=timeline.step, commit=timeline.commit), timeline.epoch

    async def epoch(self, job: str) -> int:
        """The job's current timeline: how many rollbacks it has had (0: none)."""
        timeline = await self.timeline(job)
        return timeline.epoch if timeline is not None else 0

    async def timeline(self, job: str) -> Timeline | None:
        try:
            data = await self.store.get(timeline_key(check_job(job)))
        except NotFound:
            return None
        return self._parse_timeline(job, data)

    @staticmethod
    def _parse_timeline(job: str, data: bytes) -> Timeline:
        try:
            return parse_stored(Timeline.parse, data, timeline_key(job))
        except StoreCorrupt as exc:  # the job can neither save nor commit: say the way out
            raise StoreCorrupt(f"{exc.message}; `ckptd rollback {job} STEP` (a committed "
                               "step) replaces it with a new timeline", **exc.detail) from None

    async def set_rollback(self, job: str, step: int, *, from_epoch: int | None = None
                           ) -> RollbackSet:
        """Marks ``job`` to go back to committed ``step`` (``NotCommitted`` or
        ``CheckpointNotFound`` otherwise) and starts a new timeline: manifests saved
        before it are refused from now on.

        ``from_epoch`` is the timeline the asking rank is in. A rank that has not yet
        rolled back to the latest rollback asks from an ended timeline: while that
        rollback is marked, its request is already answered, and the current marker
        and epoch come back unchanged.

        One at a time per job in this process: every rank of a job sees the same NaN
        and asks at once, and its requests meet at the job's home replica. Without the
        lock a second asker could find the new timeline written but not yet its
        marker, and start a timeline of its own (refusing the saves of the ranks that
        had rolled back to the first)."""
        async with self._one_rollback_at_a_time(check_job(job)):
            return await self._start_rollback(job, step, from_epoch)

    async def _start_rollback(self, job: str, step: int, from_epoch: int | None
                              ) -> RollbackSet:
        record = await self.read_commit(job, step)
        damage = await self.step_damage(record)
        if damage is not None:  # every rank would be sent to a step it cannot restore
            key, what = damage
            raise StoreCorrupt(f"{what}: step {step} of {job} cannot be restored, so no rank "
                               "is sent back to it; roll back to an intact step (ckptd ls "
                               f"{job} marks the damaged ones)", key=key, job=job, step=step)
        new = Ref(step=step, commit=record.digest())
        # The timeline first: between the two writes, saves are refused until the
        # marker tells the ranks to roll back; the other order could let a rank
        # restore, see the old epoch and keep it.
        key = timeline_key(job)
        floor: int | None = None  # (a damaged timeline's: counted once)
        for _ in range(100):
            try:
                current: bytes | None = await self.store.get(key)
            except NotFound:
                current = None
            try:
                done = self._parse_timeline(job, current) if current is not None else None
            except StoreCorrupt:
                if from_epoch is not None:  # a rank's: it cannot know what the job's was
                    raise
                if floor is None:
                    floor = await self._epoch_above_damage(job)
                done, epoch = None, floor
            else:
                epoch = done.epoch if done is not None else 0
            # Asked from an ended timeline while its rollback is still marked: that
            # rollback answers it. (Once the marker is cleared, it is a new one.)
            if (done is not None and from_epoch is not None and from_epoch < epoch
                    and await self.read_rollback(job) is not None):
                return RollbackSet(Ref(step=done.step, commit=done.commit), epoch,
                                   started=False)
            data = Timeline(epoch=epoch + 1, step=step, commit=new.commit).canonical()
            if await self.store.compare_and_swap(key, current, data):
                epoch += 1
                break
        else:
            raise Conflict(f"could not start a new timeline of {job}: too much contention")
        data = new.canonical()
        key = self._rollback_key(job)
        for _ in range(100):
            try:
                current = await self.store.get(key)
            except NotFound:
                current = None
            if current == data or await self.store.compare_and_swap(key, current, data):
                log.info("rollback of %s set to step %d (timeline %d)", job, step, epoch)
                return RollbackSet(new, epoch, started=True)
        raise Conflict(f"could not set the rollback marker of {job}: too much contention")

    async def _epoch_above_damage(self, job: str) -> int:
        """Where an operator's rollback over a damaged timeline counts from (its new
        epoch is one more): the time now in seconds, or the highest epoch of the job's
        manifests if more (a clock set back). Epochs are only ever compared, so the
        count may jump: the new timeline must lie above the lost one and above every
        rollback the damage hid that no manifest shows (a rollback takes more than a
        second). Ranks of the lost timeline are then refused and told."""
        steps = await self.step_numbers(job)
        ranks = await _batched([functools.partial(self._ranks_present, job, s) for s in steps])
        pairs = [(s, r) for s, present in zip(steps, ranks, strict=True) for r in present]

        async def epoch_of(step: int, rank: int) -> int:
            try:
                return manifest_epoch(await self._read_manifest_raw(job, step, rank))
            except (StoreCorrupt, InvalidDocument, UnsupportedFormat, ManifestNotFound):
                return 0  # damaged too, a newer ckptd's, or gone since: the others count

        epochs = await _batched([functools.partial(epoch_of, s, r) for s, r in pairs])
        highest = max(epochs, default=0)
        floor = max(int(time.time()), highest + 1)
        log.warning("%s: replacing its damaged timeline with timeline %d (its manifests were "
                    "saved in timelines up to %d)", job, floor + 1, highest)
        return floor


    async def clear_rollback(self, job: str) -> bool:
        """Removes the job's rollback marker; True when there was one."""
        key = self._rollback_key(check_job(job))
        try:
            seen = await self.store.get(key)
        except NotFound:
            return False
        # Compare-and-delete: a rollback set after we looked (a newer one) stays.
        if not await self.store.compare_and_delete(key, seen):
            log.info("rollback of %s changed while clearing it; the newer one stays", job)
            return False
        log.info("rollback of %s cleared", job)
        return True

    async def end_rollback_passed(self, job: str, step: int, epoch: int) -> bool:
        """Clears the rollback marker when ``step``, committed in timeline ``epoch``,
        is past the marker's step in the marker's own timeline; True when it did."""
        key = self._rollback_key(job)
        try:
            seen = await self.store.get(key)
        except NotFound:
            return False
        # Only a commit of the rollback's own timeline shows the job moved on: one of
        # the ended timeline (in flight when the rollback began) can land after the
        # marker, and clearing then would leave ranks that never heard of it behind.
        timeline = await self.timeline(job)
        if timeline is None or timeline.epoch != epoch or step <= timeline.step:
            return False
        if not await self.store.compare_and_delete(key, seen):
            return False  # a newer rollback, to another step: it stays
        # A rollback to the same step begun since the look wrote the same bytes (or
        # none): it must stay marked, so put them back. Not knowing (the timeline
        # unreadable), put them back too: a marker kept too long is cleared by the
        # next commit past it (and ranks already in its timeline are not told again);
        # one lost leaves a new timeline's ranks never told of their rollback.
        try:
            after = await self.timeline(job)
        except BaseException:
            await self._mark_again(key, seen)
            raise
        if after is not None and after.epoch != epoch:
            await self._mark_again(key, seen)
            return False
        log.info("rollback of %s cleared: step %d committed in timeline %d", job, step, epoch)
        return True

    async def _mark_again(self, key: str, marker: bytes) -> None:
        """Puts a rollback marker just deleted back, trying a few times (a store
        error here would lose a rollback)."""
        for attempt in range(4):
            try:
                await self.store.put_if_absent(key, marker)
                return
            except StoreError:
                if attempt == 3:
                    raise
                await asyncio.sleep(0.1 * 2**attempt)

    async def _check_epoch(self, job: str, epoch: int, what: str) -> int:
        """Refuses work of a timeline other than the job's current one."""
        current = await self.epoch(job)
        if epoch < current:
            raise Superseded(
                f"{what} of {job} was saved in timeline {epoch}, which a rollback ended "
                f"(the job is in timeline {current}); restore the rollback's step first",
                job=job, epoch=epoch, current=current,
            )
        if epoch > current:
            raise Conflict(
                f"{what} of {job} names timeline {epoch}, but the job is in timeline "
                f"{current}", job=job, epoch=epoch, current=current,
            )
        return current


async def _batched(calls: list[Callable[[], Awaitable[_T]]], width: int = 32) -> list[_T]:
    """Each call's result, in order, ``width`` at a time."""
    out: list[_T] = []
    for i in range(0, len(calls), width):
        out.extend(await asyncio.gather(*(call() for call in calls[i:i + width])))
    return out
