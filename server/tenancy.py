"""Which chunks a scoped caller may learn of (docs/design/006-tenants.md).

Chunks are content-addressed and shared by every job of a store, so "is chunk X
stored?" and "give me chunk X" are questions about other tenants' data unless
answered per tenant. A caller whose token covers every job (the server's own
token, a ``*`` token) sees the store as it is. A scoped caller acts for one job
(its token's exact job, or the ``X-Ckptd-Job`` header within its pattern) and
sees a chunk only if that job may know of it:

- the job's committed manifests name it (read once per step: they never change), or
- a caller of the job uploaded it through this process (proof of possession: it
  sent the bytes), kept in a bounded set per job.

Anything else is "missing" to it: it uploads the bytes (proving it holds them),
the store keeps one copy, and the answer does not say whether one was there."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptd.errors import CkptdError
from ckptd.repository import Repository
from ckptd.server.registry import StoreViews

log = logging.getLogger(__name__)

# Ids remembered per job as uploaded through this process (proof of possession).
UPLOADED_PER_JOB = 1 << 20
# Ids of committed manifests kept per job; past this a job's older steps are not
# scanned (their unchanged chunks are then simply sent again).
SCANNED_PER_JOB = 4 << 20
# Steps scanned, newest first, for one question; a question about ids the job does
# not hold scans at most this many steps it has not scanned before.
SCAN_STEPS = 64


@dataclass(slots=True)
class _JobChunks:
    uploaded: OrderedDict[str, None] = field(default_factory=OrderedDict)
    scanned_steps: set[int] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    scan_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class TenantChunks:
    """Per job, the chunk ids it may learn of."""

    def __init__(self, repo: Repository, views: StoreViews) -> None:
        self.repo = repo
        self.views = views
        self._jobs: dict[str, _JobChunks] = {}
        self._lock = threading.Lock()

    def _job(self, job: str) -> _JobChunks:
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                j = self._jobs[job] = _JobChunks()
            return j

    def uploaded(self, job: str, cid: str) -> bool:
        """Records that a caller of ``job`` sent chunk ``cid``; whether it knew of it."""
        j = self._job(job)
        with self._lock:
            knew = cid in j.uploaded or cid in j.committed
            j.uploaded[cid] = None
            j.uploaded.move_to_end(cid)
            while len(j.uploaded) > UPLOADED_PER_JOB:
                j.uploaded.popitem(last=False)
        return knew

    async def known(self, job: str, ids: list[str]) -> set[str]:
        """Which of ``ids`` (stored chunks) ``job`` may know of."""
        j = self._job(job)
        with self._lock:
            found = {cid for cid in ids if cid in j.uploaded or cid in j.committed}
        rest = [cid for cid in ids if cid not in found]
        if rest:
            await self._scan(job, j)
            with self._lock:
                found.update(cid for cid in rest if cid in j.committed)
        return found

    async def _scan(self, job: str, j: _JobChunks) -> None:
        """Adds the chunk ids of committed steps not scanned yet, newest first."""
        async with j.scan_lock:
            try:
                steps = await self.repo.step_numbers(job)
            except CkptdError as exc:
                log.warning("%s: cannot list steps for chunk visibility: %s", job, exc)
                return
            todo = [s for s in reversed(steps) if s not in j.scanned_steps][:SCAN_STEPS]
            for step in todo:
                if len(j.committed) >= SCANNED_PER_JOB:
                    return
                record = await self.views.commit(job, step)
                if record is None:
                    continue  # pending: its chunks count once uploaded, or once it commits
                ids: set[str] = set()
                for rank in range(record.world_size):
                    try:
                        ids |= await self.views.chunk_ids(job, step, rank)
                    except CkptdError as exc:
                        log.warning("%s step %d rank %d: unreadable manifest: %s",
                                    job, step, rank, exc)
                with self._lock:
                    j.committed |= ids
                    j.scanned_steps.add(step)
