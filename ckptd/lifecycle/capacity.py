"""Capacity: bytes stored per job, bytes unique to each step, dedup, space left;
and the guard that refuses new snapshots before the disk is full."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ckptd.errors import CkptdError, StoreCorrupt, StoreFull, UnsupportedFormat
from ckptd.format import CommitRecord
from ckptd.lifecycle.gc import _CHUNK_KEY
from ckptd.repository import Repository
from ckptd.store.base import Store
from ckptd.store.local import LocalStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepSpace:
    step: int
    logical_bytes: int
    unique_bytes: int  # what forgetting this step (and collecting) would free


@dataclass(slots=True)
class JobSpace:
    job: str
    stored_bytes: int = 0  # distinct chunks the job's committed steps name
    logical_bytes: int = 0  # the steps' state, summed
    steps: list[StepSpace] = field(default_factory=list)

    @property
    def dedup_ratio(self) -> float | None:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None


@dataclass(slots=True)
class StoreSpace:
    chunk_bytes: int = 0  # every chunk in the store, garbage included
    chunks: int = 0
    free_bytes: int | None = None  # None: the backend has no such limit to report
    total_bytes: int | None = None
    jobs: list[JobSpace] = field(default_factory=list)
    taken_at: float = field(default_factory=time.time)
    damaged: list[str] = field(default_factory=list)  # documents not counted, each named


def disk_space(store: Store) -> tuple[int, int] | None:
    """(free, total) bytes of the file system under a local store; None elsewhere."""
    if isinstance(store, LocalStore):
        usage = shutil.disk_usage(store.root)
        return usage.free, usage.total
    return None


async def committed_steps(
    repo: Repository, damaged: list[str] | None = None
) -> AsyncIterator[tuple[str, int, CommitRecord, set[str]]]:
    """(job, step, commit record, chunk ids its verified manifests name) of every
    committed step; a manifest that does not verify is skipped (verify names it),
    and so is a damaged commit record (named in ``damaged``, when given)."""
    for job in await repo.list_jobs():
        for step in await repo.step_numbers(job):
            try:
                record = await repo.try_read_commit(job, step)
            except (StoreCorrupt, UnsupportedFormat) as exc:  # one bad step hides nothing else
                log.warning("%s step %d: %s", job, step, exc)
                if damaged is not None:
                    damaged.append(exc.message)
                continue
            if record is None:
                continue
            ids: set[str] = set()
            for rank in range(record.world_size):
                try:
                    ids |= (await repo.read_manifest(job, step, rank)).chunk_ids()
                except CkptdError as exc:
                    log.warning("%s step %d rank %d: %s", job, step, rank, exc)
            yield job, step, record, ids


async def census(repo: Repository) -> StoreSpace:
    """Walks every committed step's manifests once (a background task's work)."""
    space = StoreSpace()
    sizes: dict[str, int] = {}
    async for info in repo.store.list_info("chunks/"):
        if m := _CHUNK_KEY.match(info.key):
            sizes[m.group(2)] = info.size
    space.chunks, space.chunk_bytes = len(sizes), sum(sizes.values())
    disk = await asyncio.to_thread(disk_space, repo.store)
    if disk is not None:
        space.free_bytes, space.total_bytes = disk
    named: dict[tuple[str, int], set[str]] = {}
    logical: dict[tuple[str, int], int] = {}
    async for job, step, record, ids in committed_steps(repo, space.damaged):
        named[(job, step)] = ids
        logical[(job, step)] = record.report.logical_bytes
    refs: Counter[str] = Counter()
    for ids in named.values():
        refs.update(ids)
    by_job: dict[str, JobSpace] = {}
    for (job, step), ids in sorted(named.items()):
        js = by_job.setdefault(job, JobSpace(job))
        unique = sum(sizes.get(c, 0) for c in ids if refs[c] == 1)
        js.steps.append(StepSpace(step, logical[(job, step)], unique))
        js.logical_bytes += logical[(job, step)]
    for job, js in by_job.items():
        distinct = set().union(*(ids for (j, _), ids in named.items() if j == job))
        js.stored_bytes = sum(sizes.get(c, 0) for c in distinct)
    space.jobs = list(by_job.values())
    return space


class SpaceGuard:
    """Refuses a new snapshot (``StoreFull``) while less than ``min_free_bytes`` is
    left, and warns below ``warn_free_bytes``; a no-op where the backend reports
    no free space (S3, memory)."""

    def __init__(self, store: Store, *, min_free_bytes: int, warn_free_bytes: int) -> None:
        self.store = store
        self.min_free_bytes = min_free_bytes
        self.warn_free_bytes = warn_free_bytes
        self._warned = 0.0

    async def __call__(self) -> None:
        disk = disk_space(self.store)
        if disk is None:
            return
        free = disk[0]
        if free < self.min_free_bytes:
            raise StoreFull(
                f"the store has {free} bytes left, under the {self.min_free_bytes} kept free; "
                "forget old steps (ckptd forget JOB) and collect garbage (ckptd gc)",
                free_bytes=free, min_free_bytes=self.min_free_bytes,
            )
        if free < self.warn_free_bytes and time.monotonic() - self._warned > 60:
            self._warned = time.monotonic()
            log.warning("the store has %d bytes left (warning below %d); new snapshots are "
                        "refused below %d", free, self.warn_free_bytes, self.min_free_bytes)
