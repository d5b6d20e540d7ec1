"""Listings: jobs, steps, the newest step scrub has not marked damaged, and the
one choice of the step a restore of ``latest`` gets."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from typing import TypedDict

from ckptd.errors import (
    AlreadyCommitted,
    CheckpointNotFound,
    NotFound,
    StoreCorrupt,
    UnsupportedFormat,
)
from ckptd.format import (
    EPOCH_META,
    FORMAT_VERSION,
    JOB_RE,
    MAX_STEP,
    CommitRecord,
    RankManifest,
    Timeline,
    check_step,
    commit_key,
    job_prefix,
    latest_key,
    manifest_epoch,
    manifest_key,
    removal_key,
)
from ckptd.hashing import document_hash
from ckptd.lifecycle.documents import damage_key, damage_prefix
from ckptd.lifecycle.tags import read_tags
from ckptd.repository.results import RestorableStep, StepInfo
from ckptd.repository.timelines import Timelines

log = logging.getLogger(__name__)

# How long a step whose rank manifests all matched its record stays checked for the
# choice of "latest" (every rank of a restore asks; each plan still hash-checks the
# manifests it serves), and how many such checks a repository keeps.
INTACT_FOR = 10.0
INTACT_CHECKS = 1024
# A damaged timeline's stand-in while a rollback marker is set: every commit record's
# timeline is older than this one, so every step above the marker's was left behind.
_ABOVE_EVERY_EPOCH = 2**62
# The top-level version of a rank manifest in canonical JSON (keys sorted, compact):
# the last two keys of the document are "version" and "world_size".
_MANIFEST_VERSION = re.compile(rb',"version":(-?\d+),"world_size":\d+}$')

#: A stored document this ckptd cannot read: damaged, or of a newer format. A listing
#: shows it against its job or step and goes on with the others.
UNREADABLE = (StoreCorrupt, UnsupportedFormat)


class Unreadable(TypedDict, total=False):
    """The listing field that says why a document cannot be read (one of them)."""

    damaged: str
    unsupported: str  # a newer ckptd wrote it: upgrade; nothing is damaged


def unreadable(exc: StoreCorrupt | UnsupportedFormat) -> Unreadable:
    """``exc`` as the field a listing shows it in."""
    if isinstance(exc, UnsupportedFormat):
        return {"unsupported": exc.message}
    return {"damaged": exc.message}


class Listings(Timelines):
    """Jobs and steps as the server and the CLI show them, and which step a
    restore of ``latest`` gets."""

    async def latest(self, job: str) -> int | None:
        """The newest committed step of ``job`` on its current timeline that scrub
        has not marked damaged (what a restore of ``latest`` gets), or None."""
        step = await self.latest_ref_step(job)
        if step is None:
            return None
        if (await self.store.exists(damage_key(job, step))
                or await self._abandoned(job, step, await self._path(job))):
            return await self.newest_undamaged_step(job)
        return step

    async def newest_undamaged_step(self, job: str) -> int | None:
        """The newest committed step on the current timeline without a scrub damage
        marker, or None."""
        damaged = {n.removesuffix(".json") for n in await self.store.list_dir(damage_prefix(job))}
        path = await self._path(job)
        for step in reversed(await self.step_numbers(job)):
            if (str(step) not in damaged and await self.store.exists(commit_key(job, step))
                    and not await self._abandoned(job, step, path)):
                return step
        return None

    async def _path(self, job: str) -> Timeline | None:
        """The job's timeline, as ``latest`` reads it (None: it has none).

        A damaged one no longer says which committed steps a rollback left behind.
        While the rollback marker is set, its step is where a restore of ``latest``
        goes (as with an intact timeline: every step above it was left behind, since
        the first commit past it in the new timeline clears the marker). Without a
        marker nothing tells the steps apart: ``StoreCorrupt`` naming the timeline,
        never a step the operator rolled back from."""
        try:
            return await self.timeline(job)
        except StoreCorrupt as exc:
            try:
                marker = await self.read_rollback(job)
            except UNREADABLE:
                marker = None
            if marker is None:
                raise StoreCorrupt(
                    f"{exc.message} (until then no step is latest: it says which steps a "
                    "rollback left behind; a restore that names its step still reads it)",
                    **exc.detail) from None
            # Every step above the marker's was saved in an older timeline than this.
            return Timeline(epoch=_ABOVE_EVERY_EPOCH, step=marker.step, commit=marker.commit)

    async def _path_or_none(self, job: str) -> Timeline | None:
        """``_path``, or None when it cannot be told (the damage is said elsewhere)."""
        try:
            return await self._path(job)
        except StoreCorrupt:
            return None

    async def _abandoned(self, job: str, step: int, path: Timeline | None) -> bool:
        """Whether committed ``step`` lies on a path a rollback abandoned: above the
        step the newest rollback went back to, and committed before it, in an
        ended timeline. It stays committed (commit records never change), but
        ``latest`` is no longer there: an operator's rollback to an older step
        left the newer steps behind, and the job's new path (its commits past the
        rollback's step end the rollback) is what a restart must get."""
        if path is None or step <= path.step:
            return False
        try:
            record = await self._try_read_commit(job, step)
        except StoreCorrupt:
            return False  # (damaged: the restore's own checks say so)
        return record is not None and int(record.meta.get(EPOCH_META, 0)) < path.epoch

    async def refusal_of_committed(self, manifest: RankManifest,
                                   record: CommitRecord) -> AlreadyCommitted:
        """The error for ``manifest`` put into its committed step (``record``) that is
        not one of its own. A rollback's new path saving again at a number the
        abandoned path took is ``detail.abandoned``: the job goes on (its saver skips
        that save, with a warning), it is no failure of the loop."""
        left = int(record.meta.get(EPOCH_META, 0))
        later = left < manifest_epoch(manifest)
        abandoned = later and await self._abandoned(manifest.job, manifest.step,
                                                    await self._path_or_none(manifest.job))
        return AlreadyCommitted(
            f"step {manifest.step} of {manifest.job} is committed; rank {manifest.rank}'s "
            "manifest cannot change" + (
                f" (it was committed in timeline {left}, on the path a rollback left: a "
                "step number commits once, so save the new path at other step numbers)"
                if later else ""),
            job=manifest.job, step=manifest.step, rank=manifest.rank,
            **({"abandoned": True} if abandoned else {}),
        )

    async def latest_or_damage(self, job: str) -> tuple[int | None, Unreadable]:
        """``latest(job)`` for a listing: (the step, {}), or (None, ``unreadable``'s
        field) when its ref is damaged or of a newer format."""
        try:
            return await self.latest(job), {}
        except UNREADABLE as exc:  # (info: a dashboard lists every few seconds)
            log.info("%s: %s", job, exc)
            return None, unreadable(exc)

    async def lost_commit(self, job: str, step: int) -> str | None:
        # One read first: refs name committed steps, none above ``latest``'s, so the
        # step of a save in flight (the commit polls of every rank) costs no more.
        try:
            latest = await self.latest_ref_step(job)
        except UNREADABLE:
            latest = step  # (a damaged latest names nothing; the tags may)
        if latest is None or step > latest:
            return None
        return (await self.lost_commits(job)).get(step)

    async def lost_commits(self, job: str) -> dict[int, str]:
        """Step -> what is wrong, for every step a ref names whose commit record is
        lost (``record_lost``): damaged, not pending. A damaged ref names nothing
        here (its own listing and ``verify`` say so)."""
        named: dict[int, list[str]] = {}
        for what, read in (("latest", self._latest_ref), ("rollback", self.read_rollback)):
            try:
                ref = await read(job)
            except UNREADABLE:
                continue
            if ref is not None:
                named.setdefault(ref.step, []).append(what)
        try:
            tags = await read_tags(self.store, job)
        except UNREADABLE:
            tags = {}
        for name, step in sorted(tags.items()):
            named.setdefault(step, []).append(f"tag {name}")
        lost: dict[int, str] = {}
        for step, refs in sorted(named.items()):
            if await self.record_lost(job, step):
                lost[step] = (f"damaged step: {' and '.join(refs)} of {job} "
                              f"name{'s' if len(refs) == 1 else ''} step {step}, whose "
                              f"commit record {commit_key(job, step)} is missing")
        return lost

    async def resolve_step(self, job: str, step: int | None) -> int:
        if step is not None:
            return check_step(step)
        latest = await self.latest(job)
        if latest is None:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
        return latest

    async def list_jobs(self) -> list[str]:
        jobs = []
        for name in await self.store.list_dir("jobs/"):
            if JOB_RE.fullmatch(name):
                jobs.append(name)
            else:  # made by hand, or a stray directory: not a job, and not fatal
                log.warning("ignoring %r under jobs/: not a valid job name", name[:200])
        return jobs

    async def list_steps(self, job: str) -> list[StepInfo]:
        names = await self.store.list_dir(f"{job_prefix(job)}steps/")
        steps = sorted(int(n) for n in names if n.isdigit() and int(n) < MAX_STEP)
        latest, _ = await self.latest_or_damage(job)  # the steps are still worth showing
        damaged = {n.removesuffix(".json") for n in await self.store.list_dir(damage_prefix(job))}
        sem = asyncio.Semaphore(16)

        async def info(step: int) -> StepInfo:
            async with sem:
                ranks = await self._ranks_present(job, step)
                try:
                    record = await self._try_read_commit(job, step)
                except UNREADABLE as exc:  # one damaged (or newer) step hides nothing else
                    log.info("%s step %d: %s", job, step, exc)
                    return StepInfo(step, False, None, len(ranks), None, None, False,
                                    **unreadable(exc))
                if record is not None:
                    why = (f"scrub found corrupt chunks ({damage_key(job, step)})"
                           if str(step) in damaged else None)
                    if why is None and step != latest and len(ranks) < record.world_size:
                        # (cheap: the listing's own count; latest's are read just below)
                        why = await self._manifests_lost(job, step, record.world_size)
                    if step == latest and why is None:
                        # A restore of latest checks its manifests and falls back past
                        # a damaged one: the listing says the same.
                        manifests = await self._manifests_damage(record)
                        why = manifests[1] if manifests is not None else None
                        newer = self.__dict__.get("_newer_manifests", {}).get((job, step))
                        if why is None and newer is not None:  # (no restore reads it)
                            return StepInfo(step, True, record.world_size, len(ranks),
                                            record.report.logical_bytes, record.committed_at,
                                            False, unsupported=newer)
                    return StepInfo(
                        step, True, record.world_size, len(ranks),
                        record.report.logical_bytes, record.committed_at,
                        step == latest and why is None, damaged=why,
                    )
                world = None
                if ranks:
                    try:
                        world = (await self._read_manifest_raw(job, step, ranks[0])).world_size
                    except UNREADABLE as exc:  # one bad pending manifest hides nothing else
                        log.info("%s step %d: unreadable manifest: %s", job, step, exc)
                return StepInfo(step, False, world, len(ranks), None, None, False)

        infos = list(await asyncio.gather(*(info(s) for s in steps)))
        if any(not i.committed and i.ranks_present and not i.damaged for i in infos):
            # A step a ref names is committed: without its record it is damaged, not
            # pending (read only when a step looks pending: a listing stays cheap).
            lost = await self.lost_commits(job)
            infos = [dataclasses.replace(i, damaged=lost[i.step])
                     if i.step in lost and not i.committed else i for i in infos]
        if latest is not None and (latest not in steps or any(
                i.step == latest and i.damaged for i in infos)):
            # Latest's commit record or manifests are damaged, or it names a step that
            # is not there: then latest is the step a restore of latest gets (the
            # listing agrees with /latest).
            try:
                usable = (await self.restorable_step(job)).step
            except UNREADABLE:
                usable = None
            infos = [dataclasses.replace(i, is_latest=i.step == usable and i.committed)
                     for i in infos]
        return infos

    async def _manifests_lost(self, job: str, step: int, world: int) -> str | None:
        """Why a committed step whose listing showed fewer rank manifests than its
        commit record names is damaged, or None. The manifests were listed before the
        record was read: a step that committed in between (its last ranks saved) is
        listed again, and one that retention is removing (its record goes first) is
        not damage."""
        ranks = await self._ranks_present(job, step)
        if len(ranks) >= world or not await self.store.exists(commit_key(job, step)) \
                or await self.store.exists(removal_key(job, step)):
            return None
        lost = world - len(ranks)
        return (f"damaged step: {lost} of the {world} rank manifests its commit record "
                f"names {'is' if lost == 1 else 'are'} missing")

    async def restorable_step(self, job: str) -> RestorableStep:
        """The newest committed step whose ``latest`` ref and commit record read
        cleanly: ``latest`` itself unless damage makes it unusable, then the newest
        committed step below it, with the problems that made it fall back.

        This is the one place that chooses the step a restore of "latest" gets
        (scrub's damage markers belong here too). Committed steps none of which is
        usable raise ``StoreCorrupt`` naming the first damaged document: never
        "no checkpoint", which a restarted job reads as "start from step 0"."""
        problems: list[str] = []
        damaged: list[str] = []  # the key of each problem's document
        ref_read = True
        try:
            newest = await self.latest(job)  # skips steps scrub marked damaged
            named = await self.latest_ref_step(job)
            # (else a rollback left the step behind: not damage, and nothing to say)
            if named is not None and named != newest and await self.store.exists(
                    damage_key(job, named)):
                problems.append(f"step {named} of {job} is marked damaged by scrub "
                                f"({damage_key(job, named)})")
                damaged.append(damage_key(job, named))
        except StoreCorrupt as exc:
            problems.append(exc.message)
            damaged.append(str(exc.detail.get("key", latest_key(job))))
            newest, ref_read = None, False
        if newest is not None and ref_read:
            try:
                record = await self._try_read_commit(job, newest)
                if record is not None:
                    damage = await self._manifests_damage(record)
                    if damage is None:
                        return RestorableStep(newest, problems)  # (a scrub fallback, if any)
                    damaged.append(damage[0])
                    problems.append(damage[1])
                else:
                    problems.append(f"latest names step {newest} of {job}, which has no "
                                    "commit record")
                    damaged.append(commit_key(job, newest))
            except StoreCorrupt as exc:
                problems.append(exc.message)
                damaged.append(str(exc.detail.get("key", commit_key(job, newest))))
        steps = await self.step_numbers(job)
        marked = {n.removesuffix(".json") for n in await self.store.list_dir(damage_prefix(job))}
        below = [s for s in reversed(steps)
                 if (newest is None or s < newest) and str(s) not in marked]
        chosen: int | None = None
        path = await self._path(job)
        for step in below:
            try:
                record = await self._try_read_commit(job, step)
                if record is not None and await self._abandoned(job, step, path):
                    continue  # (not damage: a rollback left it behind)
                if record is not None:
                    damage = await self._manifests_damage(record)
                    if damage is None:
                        chosen = step
                        break
                    damaged.append(damage[0])
                    problems.append(damage[1])
            except StoreCorrupt as exc:
                problems.append(exc.message)
                damaged.append(str(exc.detail.get("key", commit_key(job, step))))
        if chosen is None and problems:
            raise StoreCorrupt(
                f"job {job} has committed steps but none is usable: " + "; ".join(problems),
                key=damaged[0], keys=damaged, job=job, problems=problems,
            )
        if problems:
            # (info: each reader says it where it is seen: a restore's "latest skipped",
            # an export's warning, the server's restore_fallback event)
            log.info("%s: the newest usable step is %s, not latest: %s", job, chosen,
                        "; ".join(problems))
        return RestorableStep(chosen, problems)

    async def step_damage(self, record: CommitRecord) -> tuple[str, str] | None:
        marker = damage_key(record.job, record.step)
        if await self.store.exists(marker):
            return marker, f"step {record.step} of {record.job} is marked damaged by scrub"
        return await self._manifests_damage(record)

    async def _manifests_damage(self, record: CommitRecord) -> tuple[str, str] | None:
        """None when every rank manifest of a committed step is the one its record
        names, else the first damaged document's key and what is wrong: all ranks of
        a restore must fall back together, not only the rank whose manifest is bad.
        One check at a time per step, kept ``INTACT_FOR``."""
        # (job, step) -> (checked until, the record's manifest hashes, the check)
        checks: dict[tuple[str, int],
                     tuple[float, tuple[str, ...], asyncio.Task[tuple[str, str] | None]]]
        checks = self.__dict__.setdefault("_intact_checks", {})
        key = (record.job, record.step)
        hashes = tuple(m.hash for m in record.manifests)
        now = time.monotonic()
        held = checks.get(key)
        loop = asyncio.get_running_loop()
        if held is not None and held[1] == hashes and now < held[0] and (
                held[2].done() or held[2].get_loop() is loop):
            task = held[2]
        else:
            task = loop.create_task(self._check_manifests(record))
            checks.pop(key, None)
            checks[key] = (now + INTACT_FOR, hashes, task)
            while len(checks) > INTACT_CHECKS:
                checks.pop(next(iter(checks)))
        try:
            return await asyncio.shield(task)
        except BaseException:
            if checks.get(key, (0.0, (), None))[2] is task and task.done():
                del checks[key]  # a store error is not kept: the next call asks again
            raise

    async def manifests_damage(self, record: CommitRecord) -> tuple[str, str] | None:
        """The first damaged rank manifest of a committed step (its key, what is
        wrong), read afresh, or None when every one is the one its record names."""
        self.recheck_manifests(record.job, record.step)
        return await self._manifests_damage(record)

    def recheck_manifests(self, job: str, step: int) -> bool:
        """Drops what a check kept of ``step``'s manifests (a read of one found it
        damaged since); True when a finding was kept, so choosing again may differ."""
        checks = self.__dict__.get("_intact_checks", {})
        return checks.pop((job, step), None) is not None

    async def _check_manifests(self, record: CommitRecord) -> tuple[str, str] | None:
        sem = asyncio.Semaphore(16)

        async def damage(rank: int) -> tuple[str, str] | None:
            key = manifest_key(record.job, record.step, rank)
            async with sem:
                try:
                    data = await self.store.get(key)
                except NotFound:
                    return key, f"damaged step: {key}, named by its commit record, is missing"
                if await asyncio.to_thread(document_hash, data) != record.manifests[rank].hash:
                    return key, (f"damaged document {key}: its bytes are not those its "
                                 "commit record names")
                m = _MANIFEST_VERSION.search(data[-64:])
                if m is not None and (version := int(m[1])) != FORMAT_VERSION:
                    newer.setdefault(rank, f"{key}: rank manifest has format version {version}; "
                                     f"this ckptd reads version {FORMAT_VERSION}; it was "
                                     "written by a newer ckptd: upgrade ckptd")
                return None

        # A manifest of a newer format is no damage (nothing falls back around it) but
        # no restore reads it: a listing says so, from the bytes this check read.
        newer: dict[int, str] = {}
        said: dict[tuple[str, int], str] = self.__dict__.setdefault("_newer_manifests", {})

        found = [d for d in await asyncio.gather(*(damage(r) for r in range(record.world_size)))
                 if d is not None]
        said.pop((record.job, record.step), None)
        if newer:
            said[(record.job, record.step)] = newer[min(newer)]
            while len(said) > INTACT_CHECKS:
                said.pop(next(iter(said)))
        if not found:
            return None
        more = len(found) - 1
        return found[0][0], found[0][1] + (
            f" (and {more} more manifests of step {record.step})" if more else "")
