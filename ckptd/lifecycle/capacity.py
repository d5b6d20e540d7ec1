"""Capacity: what the census reports (bytes stored per job, bytes unique to each
step, dedup, space left; counted by ``ckptd.lifecycle.census``), and the guard
that refuses new snapshots before the disk is full."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ckptd.errors import CkptdError, StoreCorrupt, StoreFull, UnsupportedFormat
from ckptd.format import CommitRecord
from ckptd.knobs import human_bytes
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
    """What the census (``ckptd.lifecycle.census``) counted, as of ``taken_at``."""

    chunk_bytes: int = 0  # every chunk in the store, garbage included, as last listed
    chunks: int = 0
    free_bytes: int | None = None  # None: the backend has no such limit to report
    total_bytes: int | None = None
    jobs: list[JobSpace] = field(default_factory=list)
    taken_at: float = field(default_factory=time.time)
    damaged: list[str] = field(default_factory=list)  # documents not counted, each named
    chunks_listed_at: float | None = None  # when chunks/ was listed (None: not yet)
    referenced_bytes: int = 0  # distinct chunks that the counted steps name
    referenced_chunks: int = 0
    # In the store and named by no counted step: what a collection deletes (but for
    # chunks of saves still under way)
    unreferenced_chunks: int = 0
    unreferenced_bytes: int = 0
    uncounted_steps: int = 0  # committed steps found and not counted yet
    # chunks/ is listed again: steps went before they were counted, their chunks not
    listing_again: bool = False
    complete: bool = True  # every committed step counted, chunks/ listed


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
                f"the store has {human_bytes(free)} left, under the "
                f"{human_bytes(self.min_free_bytes)} it keeps free (CKPTD_MIN_FREE_BYTES): "
                "forget old steps (ckptd forget JOB) and collect garbage (ckptd gc), give "
                "the store more space, or lower CKPTD_MIN_FREE_BYTES on a small disk",
                free_bytes=free, min_free_bytes=self.min_free_bytes,
            )
        if free < self.warn_free_bytes and time.monotonic() - self._warned > 60:
            self._warned = time.monotonic()
            log.warning("the store has %d bytes left (warning below %d); new snapshots are "
                        "refused below %d", free, self.warn_free_bytes, self.min_free_bytes)
