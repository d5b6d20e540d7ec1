"""Short-lived copies of the store's refs and cached immutable documents, so that
a heartbeat does not cost a store read (the registry's durable side)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ckptd.errors import CkptdError
from ckptd.format import CommitRecord, Ref
from ckptd.repository import Repository
from ckptd.repository.listings import UNREADABLE

log = logging.getLogger(__name__)


class _Lru(OrderedDict[Any, Any]):
    """At most ``size`` entries, and at most ``weight`` of ``weigh(value)`` together
    (the one entry put last is kept whatever it weighs)."""

    def __init__(self, size: int, weight: int | None = None,
                 weigh: Callable[[Any], int] = lambda value: 1) -> None:
        super().__init__()
        self.size = size
        self.weight = weight
        self.weigh = weigh
        self.held = 0  # the entries' weight together

    def put(self, key: Any, value: Any) -> None:
        self.drop(key)
        self[key] = value
        self.held += self.weigh(value)
        while len(self) > 1 and (len(self) > self.size
                                 or (self.weight is not None and self.held > self.weight)):
            _, old = self.popitem(last=False)
            self.held -= self.weigh(old)

    def drop(self, key: Any) -> None:
        old = self.pop(key, None)
        if old is not None:
            self.held -= self.weigh(old)


# A commit record is immutable, but the document holding it may be damaged at rest
# after it was read: one held this many ``ttl`` (a minute at the default heartbeat
# interval) is read again, so the dashboard and ``GET /v1/overview`` show the damage
# as ``ckptd ls`` does, not the copy read before it, until the server restarts.
RECHECK_TTLS = 30

# Chunk ids of rank manifests held (a restore plan asks for every peer's): about
# 150 bytes each, so at most ~150 MiB whatever the manifests' sizes.
CHUNK_IDS_HELD = 1 << 20


class StoreViews:
    """Short-lived copies of the store's refs (``latest``, the rollback marker) and
    cached immutable documents (commit records, the chunk ids of rank manifests)."""

    def __init__(
        self, repo: Repository, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.repo = repo
        self.ttl = ttl
        self._clock = clock
        self._latest: dict[str, tuple[float, int | None]] = {}
        self._rollback: dict[str, tuple[float, Ref | None, int]] = {}
        self._commits: _Lru = _Lru(4096)  # (job, step) -> (recheck at, record)
        self._reading: dict[tuple[str, int], asyncio.Future[CommitRecord | None]] = {}
        self._chunk_ids: _Lru = _Lru(8192, CHUNK_IDS_HELD, len)

    async def latest(self, job: str, *, fresh: bool = False) -> int | None:
        now = self._clock()
        held = self._latest.get(job)
        if held is not None and not fresh and now - held[0] < self.ttl:
            return held[1]
        try:
            step = await self.repo.latest(job)
        except UNREADABLE:
            # Damaged: read as None (the dashboard then asks which document), not as
            # the step the ref named before it was.
            step = None
        except CkptdError as exc:  # keep answering heartbeats while the store hiccups
            log.warning("%s: cannot read latest: %s", job, exc)
            return held[1] if held is not None else None
        self._latest[job] = (now, step)
        return step

    async def rollback(self, job: str, *, fresh: bool = False) -> Ref | None:
        """The job's rollback marker, at most ``ttl`` old."""
        return (await self._rollback_view(job, fresh))[0]

    async def epoch(self, job: str, *, fresh: bool = False) -> int:
        """The job's timeline (rollbacks so far), read with the marker."""
        return (await self._rollback_view(job, fresh))[1]

    async def _rollback_view(self, job: str, fresh: bool) -> tuple[Ref | None, int]:
        now = self._clock()
        held = self._rollback.get(job)
        if held is not None and not fresh and now - held[0] < self.ttl:
            return held[1], held[2]
        try:
            ref, epoch = await self.repo.rollback_state(job)
        except CkptdError as exc:
            log.warning("%s: cannot read the rollback marker: %s", job, exc)
            return (held[1], held[2]) if held is not None else (None, 0)
        self._rollback[job] = (now, ref, epoch)
        return ref, epoch

    def note_commit(self, job: str, step: int) -> None:
        """A step committed through this server: ``latest`` is at least ``step`` now."""
        held = self._latest.get(job)
        if held is not None and (held[1] is None or held[1] < step):
            self._latest[job] = (held[0], step)

    def set_rollback(self, job: str, ref: Ref | None, epoch: int) -> None:
        self._rollback[job] = (self._clock(), ref, epoch)

    async def commit(self, job: str, step: int) -> CommitRecord | None:
        """The commit record of ``step`` or None; records are immutable, so kept, and
        read again about every ``RECHECK_TTLS`` ttl (``store_corrupt`` once damaged at
        rest; the copy held, and asked again a period later, while the store does not
        answer). One read per record at a time, whoever asks meanwhile (a step's
        ranks asking for their plans together), and the rechecks spread over the
        period, not all due at once (a dashboard of 1000 steps)."""
        key = (job, step)
        held: tuple[float, CommitRecord] | None = self._commits.get(key)
        if held is not None and self._clock() < held[0]:
            return held[1]
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = asyncio.ensure_future(self._read_commit(key, held))
            reading.add_done_callback(lambda done: self._done_reading(key, done))
        return await asyncio.shield(reading)

    def _done_reading(self, key: tuple[str, int],
                      done: asyncio.Future[CommitRecord | None]) -> None:
        self._reading.pop(key, None)
        if not done.cancelled():
            done.exception()  # (its callers, if all were cancelled, never read it)

    async def _read_commit(self, key: tuple[str, int],
                           held: tuple[float, CommitRecord] | None) -> CommitRecord | None:
        job, step = key
        try:
            record = await self.repo.try_read_commit(job, step)
        except UNREADABLE:
            self._commits.drop(key)
            raise
        except CkptdError:
            if held is None:
                raise
            self._commits.put(key, (self._recheck_at(), held[1]))
            return held[1]
        if record is None:
            self._commits.drop(key)  # (forgotten meanwhile)
        else:
            self._commits.put(key, (self._recheck_at(), record))
        return record

    def _recheck_at(self) -> float:
        period = RECHECK_TTLS * self.ttl
        return self._clock() + period * random.uniform(0.75, 1.25)

    def forget(self, job: str, steps: list[int]) -> None:
        """Retention forgot these steps: their documents leave the caches (a server
        up for weeks holds the steps the store holds, not every step it saw)."""
        gone = set(steps)
        for key in [k for k in self._commits if k[0] == job and k[1] in gone]:
            self._commits.drop(key)
        for key in [k for k in self._chunk_ids if k[0] == job and k[1] in gone]:
            self._chunk_ids.drop(key)

    async def chunk_ids(self, job: str, step: int, rank: int) -> frozenset[str]:
        """The chunk ids of a committed rank manifest (hash-checked when read)."""
        ids: frozenset[str] | None = self._chunk_ids.get((job, step, rank))
        if ids is None:
            manifest = await self.repo.read_manifest(job, step, rank)
            ids = frozenset(manifest.chunk_ids())
            self._chunk_ids.put((job, step, rank), ids)
        return ids
