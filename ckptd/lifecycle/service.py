"""The server's lifecycle tasks: retention after commits, garbage collection,
scrub and the capacity census, each on its own interval, in the background.
Commits, retention and collections made here tell the census what they changed."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CkptdError, GcInProgress, InvalidRequest, ManifestNotFound
from ckptd.lifecycle.capacity import StoreSpace
from ckptd.lifecycle.census import Census
from ckptd.lifecycle.damaged_chunks import DamagedChunks
from ckptd.lifecycle.gc import GcReport, check_grace, collect_garbage
from ckptd.lifecycle.retention import (
    ForgetPlan,
    RetentionConfig,
    RetentionPolicy,
    forget,
    forget_damaged_step,
)
from ckptd.lifecycle.scrub import ChunkSource, ScrubProgress, ScrubReport, scrub
from ckptd.repository import Repository

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """Intervals in seconds; 0 turns a task off."""

    retention: RetentionConfig | None = None
    retention_tick: float = 2.0
    gc_interval: float = 0.0
    gc_grace: float = 600.0
    gc_lease: float = 60.0
    scrub_interval: float = 0.0
    scrub_budget_bytes: int = 256 << 20
    scrub_rate_bytes_per_s: float = 64 << 20
    census_interval: float = 60.0  # full passes of the census (0: only when asked)
    census_list_interval: float = 600.0  # listings of chunks/ (a collection's count too)
    census_cpu_share: float = 0.5  # of one core, at most, for the census worker
    census_process: bool = True  # the census counts in a process of its own


@dataclass(slots=True)
class GcRun:
    """One background collection: when it started, its grace period, and (once it
    ended) its report or its error."""

    id: str
    started_at: float
    grace: float
    ended_at: float | None = None
    report: GcReport | None = None
    error: dict[str, Any] | None = None


@dataclass(slots=True)
class ScrubRun:
    """One background scrub: when it started, its budget (None: a whole pass), how
    far it is, and (once it ended) its report or its error."""

    id: str
    started_at: float
    budget_bytes: int | None
    progress: ScrubProgress
    ended_at: float | None = None
    report: ScrubReport | None = None
    error: dict[str, Any] | None = None


class LifecycleService:
    """Runs the tasks and keeps their last results for views and metrics."""

    def __init__(
        self,
        repo: Repository,
        settings: LifecycleSettings,
        *,
        sources: Callable[[], Sequence[ChunkSource]] = lambda: (),
    ) -> None:
        self.repo = repo
        self.settings = settings
        self.sources = sources
        # The chunks scrub marked, as the dedup sees them (its own scrubs refresh it).
        self.damaged = DamagedChunks(repo)
        self.last_gc: GcReport | None = None
        self.last_scrub: ScrubReport | None = None
        self.census = Census(
            repo, interval=settings.census_interval,
            list_interval=settings.census_list_interval,
            cpu_share=settings.census_cpu_share, process=settings.census_process)
        self.last_forget: dict[str, ForgetPlan] = {}
        self.gc_runs = 0
        self.gc_bytes_freed = 0
        self.scrub_bytes = 0
        self.scrub_corrupt = 0
        self._seen_latest: dict[str, int | None] = {}
        self._retention_missed: set[str] = set()  # (jobs whose last pass met a removal)
        self._tasks: list[asyncio.Task[None]] = []
        # A collection a client started and does not wait for (POST /v1/gc/runs).
        self.gc_run: GcRun | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self.last_run: GcRun | None = None  # the last one that ended, with its outcome
        # A scrub a client started and follows (POST /v1/scrub/runs), and the last ended.
        self.scrub_run: ScrubRun | None = None
        self._scrub_task: asyncio.Task[None] | None = None
        self.last_scrub_run: ScrubRun | None = None
        #: told (job, steps) of the steps retention forgot through this server, after
        #: the census: a server's caches of them go with them (they must return at once)
        self.on_forgotten: list[Callable[[str, list[int]], None]] = []
        #: awaited last when it stops (a replica store's client is closed)
        self.on_stop: list[Callable[[], Awaitable[None]]] = []

    @property
    def space(self) -> StoreSpace | None:
        """The census's last view (None before its first)."""
        return self.census.space

    def start(self) -> None:
        s = self.settings
        self.repo.on_committed = self.census.note_commit
        self._tasks.append(self.census.start())
        loops: list[tuple[str, float, Callable[[], Awaitable[object]]]] = []
        if s.retention is not None and s.retention_tick > 0:
            loops.append(("retention", s.retention_tick, self.apply_retention))
        if s.gc_interval > 0:
            loops.append(("gc", s.gc_interval, self._scheduled_collection))
        if s.scrub_interval > 0:
            loops.append(("scrub", s.scrub_interval, self._scheduled_scrub))
        for name, every, work in loops:
            if every > 0:
                self._tasks.append(asyncio.create_task(self._loop(name, every, work)))

    def start_collection(self, grace: float | None = None) -> GcRun:
        """Starts a collection in the background and returns at once (a client
        polls ``gc_run`` / ``last_run``): its grace period alone may outlast a
        reverse proxy's read timeout. One at a time on a server: while one runs,
        that one is returned."""
        # Refused here, not in the run: a run that cannot start is not started.
        wait = check_grace(self.settings.gc_grace if grace is None else grace)
        if self.gc_run is not None:
            return self.gc_run
        run = GcRun(id=uuid.uuid4().hex[:12], started_at=time.time(), grace=wait)
        self.gc_run = run

        async def body() -> None:
            try:
                run.report = await self.collect(grace=wait)
            except (CkptdError, OSError) as exc:
                run.error = (exc.to_json() if isinstance(exc, CkptdError)
                             else {"code": "internal", "message": str(exc)})
                # Another replica's collection holds the lease: its turn, not a fault
                # (a scheduled run would warn at every interval). A lease lost midway is.
                turn = isinstance(exc, GcInProgress) and not exc.detail.get("lease_lost")
                (log.info if turn else log.warning)("garbage collection %s failed: %s",
                                                     run.id, exc)
            finally:
                run.ended_at = time.time()
                self.last_run, self.gc_run = run, None

        self._gc_task = asyncio.create_task(body())
        return run

    def start_scrub(self, budget_bytes: int | None = None) -> ScrubRun:
        """Starts a scrub in the background and returns at once (a client polls
        ``scrub_run`` / ``last_scrub_run``): a whole pass of a large store at the
        scrub's rate outlasts any reverse proxy's read timeout. One at a time on a
        server: while one runs, that one is returned (whatever its budget)."""
        if budget_bytes is not None and budget_bytes < 0:
            raise InvalidRequest(f"budget must be >= 0 bytes, not {budget_bytes}")
        if self.scrub_run is not None:
            return self.scrub_run
        run = ScrubRun(id=uuid.uuid4().hex[:12], started_at=time.time(),
                       budget_bytes=budget_bytes, progress=ScrubProgress())
        self.scrub_run = run

        async def body() -> None:
            try:
                run.report = await self.scrub(budget_bytes=budget_bytes, progress=run.progress)
            except Exception as exc:  # (its client reads it; nothing else would)
                run.error = (exc.to_json() if isinstance(exc, CkptdError)
                             else {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
                log.warning("scrub %s failed: %s", run.id, exc,
                            exc_info=not isinstance(exc, CkptdError | OSError))
            finally:
                run.ended_at = time.time()
                self.last_scrub_run, self.scrub_run = run, None

        self._scrub_task = asyncio.create_task(body())
        return run

    async def stop(self) -> None:
        # A background collection or scrub ends with the server (a scrub keeps its
        # place and the damage it found: the next one resumes). All are cancelled
        # first, then waited for together: their bounded wind-downs overlap.
        tasks = [t for t in (self._gc_task, self._scrub_task, *self._tasks)
                 if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self.repo.on_committed == self.census.note_commit:
            self.repo.on_committed = None
        await self.census.close()
        for close in self.on_stop:
            await close()

    async def _loop(self, name: str, every: float, work: Callable[[], Awaitable[object]]
                    ) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await work()
            except GcInProgress as exc:
                # Another replica's collection holds the lease: its turn, not a fault
                # (every replica would warn at every interval). A lease lost midway is.
                (log.warning if exc.detail.get("lease_lost") else log.info)(
                    "lifecycle %s: [%s] %s", name, exc.code, exc)
            except (CkptdError, OSError) as exc:
                log.warning("lifecycle %s failed: [%s] %s", name,
                            getattr(exc, "code", type(exc).__name__), exc)
            await asyncio.sleep(max(0.0, every - (time.monotonic() - t0)))

    async def _scheduled_collection(self) -> None:
        """The periodic collection's turn, as a run (``start_collection``): ``GET
        /v1/gc`` shows it running, and a ``ckptd gc`` through this server follows it
        (it waited out the grace period of its own run, then was refused the lease
        this one held). Skipped while a client's run goes on."""
        if self.gc_run is not None:
            return
        self.start_collection()
        if self._gc_task is not None:
            await self._gc_task

    async def _scheduled_scrub(self) -> None:
        """The periodic scrub's turn, skipped while a client's runs (``start_scrub``):
        two runs over one cursor read each chunk twice, and the one that stored its
        place second would stop keeping it."""
        if self.scrub_run is None:
            await self.scrub()

    async def apply_retention(self) -> None:
        """Applies each job's retention once its ``latest`` moved (after a commit)."""
        config = self.settings.retention
        if config is None:
            return
        for job in await self.repo.list_jobs():
            try:
                await self._apply_retention_to(job, config)
                self._retention_missed.discard(job)
            except ManifestNotFound as exc:
                # Another pass (a replica's retention, a ``ckptd forget``) removed a step
                # between this one's listing and its reading: tried again next time, said
                # when it does not go away (then it is damage).
                if job in self._retention_missed:
                    log.warning("retention of %s failed: [%s] %s", job, exc.code, exc)
                else:
                    log.info("retention of %s met a step removed meanwhile (%s); tried "
                             "again", job, exc)
                    self._retention_missed.add(job)
            except CkptdError as exc:  # one job's damaged document stops only its own
                log.warning("retention of %s failed: [%s] %s", job, exc.code, exc)

    async def _apply_retention_to(self, job: str, config: RetentionConfig) -> None:
        latest = await self.repo.latest_ref_step(job)
        if job in self._seen_latest and self._seen_latest[job] == latest:
            return
        policy = config.for_job(job)
        if policy.forgets or policy.abandon_pending_after is not None:
            plan = await forget(self.repo, job, policy)
            self.last_forget[job] = plan
            if plan.forgotten:
                if here := [s for s in plan.forgotten if s not in plan.elsewhere]:
                    log.info("retention of %s forgot steps %s", job, here)
                self._forgotten(job, plan.forgotten)
        self._seen_latest[job] = latest  # (after it: a failed pass is tried again)

    async def forget(self, job: str, policy: RetentionPolicy, *, dry_run: bool = False
                     ) -> ForgetPlan:
        """``forget`` (``POST /v1/jobs/{job}/forget``), and the census and caches told."""
        plan = await forget(self.repo, job, policy, dry_run=dry_run)
        if not dry_run and plan.forgotten:
            self._forgotten(job, plan.forgotten)
        return plan

    async def forget_damaged(self, job: str, step: int, *, dry_run: bool = False
                             ) -> ForgetPlan:
        """``forget_damaged_step``, and the caches told."""
        plan = await forget_damaged_step(self.repo, job, step, dry_run=dry_run)
        if not dry_run:
            log.warning("forgot damaged step %d of %s: %s", step, job,
                        "; ".join(plan.steps[0].reasons))
            self._forgotten(job, plan.forgotten)
        return plan

    def _forgotten(self, job: str, steps: list[int]) -> None:
        self.census.note_forgotten(job, steps)
        for hook in self.on_forgotten:
            hook(job, steps)

    async def collect(self, *, dry_run: bool = False, grace: float | None = None) -> GcReport:
        listed_at = time.time()  # (about when it lists chunks/: first, after its lease)
        report = await collect_garbage(
            self.repo.store, grace=self.settings.gc_grace if grace is None else grace,
            lease=self.settings.gc_lease, dry_run=dry_run,
        )
        if not dry_run:
            self.last_gc = report
            self.gc_runs += 1
            self.gc_bytes_freed += report.bytes_freed
            if report.generation:  # (0: it listed nothing, another collection ran)
                self.census.note_collection(
                    report.chunks_total - report.chunks_deleted,
                    report.bytes_total - report.bytes_freed, listed_at=listed_at)
        return report

    async def scrub(self, *, budget_bytes: int | None = -1,
                    progress: ScrubProgress | None = None) -> ScrubReport:
        report = await scrub(
            self.repo,
            budget_bytes=self.settings.scrub_budget_bytes if budget_bytes == -1 else budget_bytes,
            rate_bytes_per_s=self.settings.scrub_rate_bytes_per_s,
            sources=list(self.sources()),
            progress=progress,
        )
        self.damaged.forget()
        self.last_scrub = report
        self.scrub_bytes += report.bytes_checked
        self.scrub_corrupt += len(report.corrupt)
        return report

    async def refresh_space(self, wait: float = 0.5) -> StoreSpace:
        """The census's view, fresh if a pass ends within ``wait`` seconds, else as
        it stands (marked incomplete while steps are still to count)."""
        return await self.census.current(wait)
