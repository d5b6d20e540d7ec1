"""What a commit writes and checks once its record is written (or found): that the
step outlasts a removal by retention, its tag, and the ``latest`` ref moved
forward. ``Repository`` (``protocol``) builds on it; ``tag`` is also the route's
and the CLI's way to tag a committed step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from ckptd.documents import unsupported_stored
from ckptd.errors import (
    CkptdError,
    Conflict,
    InvalidDocument,
    InvalidRequest,
    NotCommitted,
    NotFound,
    StoreCorrupt,
    StoreError,
    UnsupportedFormat,
    UnsupportedStoredFormat,
)
from ckptd.format import (
    CommitRecord,
    RankManifest,
    Ref,
    commit_key,
    latest_key,
    manifest_key,
    removal_key,
)
from ckptd.lifecycle.removals import drop_damaged_claim, newer_claim
from ckptd.lifecycle.tags import TAG_META, check_new_tag, set_tag, take_back_tag
from ckptd.repository.reads import StoredReads

log = logging.getLogger(__name__)

# How long a commit waits for retention to finish removing its step (a removal
# takes moments; a retention pass that died leaves its claim behind, and the step
# then stays uncommitted until the next pass removes it).
REMOVAL_WAIT = 30.0


class AfterCommit(StoredReads):
    """The writes and checks that follow a commit record."""

    #: told (job, step) of each step committed through this repository, once its
    #: record is written or found (a server's census counts it at once); it must
    #: return at once and never fail the commit
    on_committed: Callable[[str, int], None] | None = None

    async def _outlast_removal(self, job: str, step: int, world: int, won: bool) -> None:
        """A commit record was written (``won``) or found: the step stands only if
        every rank's manifest is still there once retention is done removing the
        step (its claim, ``removal_key``, gone). Else the writer takes its record back
        and the commit fails: retention removed the step while it committed (a
        commit reads the manifests long before it writes the record)."""
        claim = removal_key(job, step)
        deadline = time.monotonic() + REMOVAL_WAIT
        while time.monotonic() < deadline:
            try:
                held = await self.store.get(claim)
            except NotFound:
                break
            if (newer := newer_claim(held, claim)) is not None:
                # A newer ckptd's retention may be removing the step: whether it stands
                # cannot be told here, and a record left without its manifests would be
                # a torn checkpoint. Said at once (waiting would end in a false "removed").
                if won:
                    await self.store.delete(commit_key(job, step))
                raise newer
            if await drop_damaged_claim(self.store, job, step):  # no pass removes under it
                break
            await asyncio.sleep(0.05)
        keys = [manifest_key(job, step, r) for r in range(world)]
        if not await self.store.exists(claim) and all(await self.store.exists_many(keys)):
            return
        if won:
            await self.store.delete(commit_key(job, step))
        raise NotCommitted(
            f"step {step} of {job} was removed by retention while it committed; it is not "
            "committed", job=job, step=step,
        )

    async def _tag_or_say(self, job: str, tag: str, step: int, world: int) -> None:
        """Tags a committed step; a failure is logged, not raised (the step is
        committed; a retry of the commit tags it). ``NotCommitted`` (the tag taken
        back) when retention removed the step meanwhile."""
        try:
            await set_tag(self.store, job, tag, step)
        except StoreCorrupt as exc:  # (a damaged tags document: its message says what to do)
            log.warning("%s step %d is committed, but its tag %r could not be set: %s",
                        job, step, tag, exc)
            return
        except CkptdError as exc:
            log.warning("%s step %d is committed, but its tag %r could not be set: %s; a "
                        "retry of the commit sets it", job, step, tag, exc)
            return
        await self._tag_stands(job, tag, step, world)

    async def tag(self, job: str, name: str, step: int) -> None:
        """Points tag ``name`` at committed ``step`` (retention keeps it); the
        errors of ``read_commit``, and ``NotCommitted`` (the tag taken back) when
        retention removed the step meanwhile."""
        record = await self.read_commit(job, step)
        await set_tag(self.store, job, name, step)
        await self._tag_stands(job, name, step, record.world_size)

    async def _tag_stands(self, job: str, tag: str, step: int, world: int) -> None:
        """A tag just set on ``step`` stands only if the step outlasts any removal;
        else it is taken back and ``NotCommitted`` raised: no tag names a removed step."""
        # Retention that read the tags before this one was set may be removing the
        # step (it reads them again once it holds the removal claim, and keeps a step
        # tagged by then). No claim and the record there: not removed (retention that
        # claims later sees the tag). Else as a commit: wait for the claim to go.
        if not await self.store.exists(removal_key(job, step)) and await self.store.exists(
                commit_key(job, step)):
            return
        try:
            await self._outlast_removal(job, step, world, False)
        except (NotCommitted, UnsupportedStoredFormat):
            await take_back_tag(self.store, job, tag, step)
            raise

    async def _advance_latest_or_say(self, job: str, record: CommitRecord) -> bool:
        """``_advance_latest``; False (logged) when the store refused the ref write.
        Every commit that stands ends here: ``on_committed`` is told."""
        try:
            await self._advance_latest(job, record)
        except StoreError as exc:
            log.warning("%s step %d is committed, but latest could not move: %s; the next "
                        "commit (or a retry of this one) moves it", job, record.step, exc)
            return False
        finally:
            self._tell_committed(job, record.step)
        return True

    def _tell_committed(self, job: str, step: int) -> None:
        if self.on_committed is None:
            return
        try:
            self.on_committed(job, step)
        except Exception:  # a listener's bug never fails a commit that stands
            log.exception("%s step %d: the commit listener failed", job, step)

    async def _advance_latest(self, job: str, record: CommitRecord) -> None:
        """Moves ``latest`` forward to ``record``'s step, never backward."""
        key = latest_key(job)
        new = Ref(step=record.step, commit=record.digest()).canonical()
        for _ in range(1000):
            try:
                current = await self.store.get(key)
            except NotFound:
                current = None
            if current is not None:
                try:
                    if Ref.parse(current).step >= record.step:
                        return
                except UnsupportedFormat as exc:  # a newer ckptd's: never replaced
                    raise unsupported_stored(exc, key) from None
                except InvalidDocument as exc:  # damaged: a committed step repairs it
                    log.warning("%s: replacing the damaged latest ref: %s", job, exc)
            if await self.store.compare_and_swap(key, current, new):
                return
        raise Conflict(f"could not move latest of {job}: too much contention")


def tag_of(manifests: Iterable[RankManifest]) -> str | None:
    """The tag a rank's save asked for (the lowest such rank's; one that is no
    tag is left out: its rank's save refused it already)."""
    for m in manifests:
        tag = m.meta.get(TAG_META)
        if isinstance(tag, str):
            try:
                check_new_tag(tag)
            except InvalidRequest:
                continue
            return tag
    return None
