"""Which chunks a scoped caller may learn of (docs/design/006-tenants.md).

Chunks are content-addressed and shared by every job of a store, so "is chunk X
stored?" and "give me chunk X" are questions about other tenants' data unless
answered per tenant. A caller whose token covers every job (the server's own
token, a ``*`` token) sees the store as it is. A scoped caller acts for one job
(its token's exact job, or the ``X-Ckptd-Job`` header within its pattern) and
sees a chunk only if that job may know of it:

- the job's committed manifests name it (read once per step: they never change),
  or a manifest of the job this process accepted names it, or
- a caller of the job uploaded it through this process (proof of possession: it
  sent the bytes), kept in a bounded set per job until a manifest names it.

What is held is per step, and goes with the step: a step retention forgot here,
or one a later listing no longer finds, takes its ids along (a server that runs
for weeks holds the ids of the steps the store holds, not of every step it saw).

Anything else is "missing" to it: it uploads the bytes (proving it holds them),
the store keeps one copy, and the answer does not say whether one was there."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptd.errors import CkptdError
from ckptd.repository import Repository
from ckptd.server.registry import StoreViews

log = logging.getLogger(__name__)

# Ids remembered per job as uploaded through this process and not yet named by a
# manifest it accepted (proof of possession for the manifest that will).
UPLOADED_PER_JOB = 1 << 20
# Ids of steps held per job; past this a job's older steps are not scanned (their
# unchanged chunks are then simply sent again).
SCANNED_PER_JOB = 4 << 20
# Steps scanned, newest first, for one question; a question about ids the job does
# not hold scans at most this many steps it has not scanned before.
SCAN_STEPS = 64
# Steps held per job at most: past this the oldest go (their ids are sent again if
# named again), whatever listing or retention said.
HELD_STEPS = 256


@dataclass(slots=True)
class _JobChunks:
    uploaded: OrderedDict[str, None] = field(default_factory=OrderedDict)
    steps: dict[int, set[str]] = field(default_factory=dict)  # step -> the ids it names
    named: dict[str, int] = field(default_factory=dict)  # id -> how many held steps name it
    scanned_steps: set[int] = field(default_factory=set)  # committed, every rank read
    scan_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def add(self, step: int, ids: Iterable[str]) -> None:
        held = self.steps.get(step)
        if held is None:
            held = self.steps[step] = set()
            while len(self.steps) > HELD_STEPS:
                self.drop(min(self.steps))
        for cid in ids:
            if cid not in held:
                held.add(cid)
                self.named[cid] = self.named.get(cid, 0) + 1
            self.uploaded.pop(cid, None)

    def drop(self, step: int) -> None:
        self.scanned_steps.discard(step)
        for cid in self.steps.pop(step, ()):
            left = self.named[cid] - 1
            if left:
                self.named[cid] = left
            else:
                del self.named[cid]


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
            if cid in j.named:
                return True
            knew = cid in j.uploaded
            j.uploaded[cid] = None
            j.uploaded.move_to_end(cid)
            while len(j.uploaded) > UPLOADED_PER_JOB:
                j.uploaded.popitem(last=False)
        return knew

    def named(self, job: str, step: int, ids: Iterable[str]) -> None:
        """A manifest of ``step`` naming ``ids`` was accepted for ``job``: they are
        the step's (and no longer held as uploaded)."""
        j = self._job(job)
        with self._lock:
            j.add(step, ids)

    def forget(self, job: str, steps: Iterable[int]) -> None:
        """Retention forgot these steps of ``job``: their ids go with them."""
        with self._lock:
            j = self._jobs.get(job)
            if j is not None:
                for step in steps:
                    j.drop(step)

    def held(self, job: str) -> tuple[int, int, int]:
        """(uploaded ids, steps, named ids) held for ``job``: what the bounds bound."""
        with self._lock:
            j = self._jobs.get(job)
            return (0, 0, 0) if j is None else (len(j.uploaded), len(j.steps), len(j.named))

    async def known(self, job: str, ids: list[str]) -> set[str]:
        """Which of ``ids`` (stored chunks) ``job`` may know of."""
        j = self._job(job)
        with self._lock:
            found = {cid for cid in ids if cid in j.uploaded or cid in j.named}
        rest = [cid for cid in ids if cid not in found]
        if rest:
            await self._scan(job, j)
            with self._lock:
                found.update(cid for cid in rest if cid in j.named)
        return found

    async def _scan(self, job: str, j: _JobChunks) -> None:
        """Adds the chunk ids of committed steps not scanned yet, newest first."""
        async with j.scan_lock:
            try:
                steps = await self.repo.step_numbers(job)
            except CkptdError as exc:
                log.warning("%s: cannot list steps for chunk visibility: %s", job, exc)
                return
            # Steps the listing lacks went (forgotten, abandoned); one newer than it
            # all may have come since it was taken.
            listed, top = set(steps), max(steps, default=-1)
            with self._lock:
                for gone in [s for s in j.steps if s < top and s not in listed]:
                    j.drop(gone)
            todo = [s for s in reversed(steps) if s not in j.scanned_steps][:SCAN_STEPS]
            for step in todo:
                if len(j.named) >= SCANNED_PER_JOB:
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
                    j.add(step, ids)
                    j.scanned_steps.add(step)
