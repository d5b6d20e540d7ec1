"""Store lifecycle over HTTP: forget, garbage collection, scrub, tags, damage and
capacity; and the background tasks, started from the app's lifespan (``start``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Annotated

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptd.api import (
    ForgetResult,
    GcResult,
    GcRunBody,
    GcStatus,
    JobSpaceBody,
    ScrubResult,
    ScrubRunBody,
    ScrubStatus,
    SpaceResult,
    StepDecisionBody,
    StepSpaceBody,
    TagBody,
)
from ckptd.errors import InvalidRequest, NotFound
from ckptd.lifecycle.capacity import SpaceGuard
from ckptd.lifecycle.gc import MAX_GRACE, GcReport, gc_state
from ckptd.lifecycle.housekeeping import remove_stale_temporaries
from ckptd.lifecycle.reserve import keep_reserve
from ckptd.lifecycle.retention import RetentionPolicy, StepDecision, load_retention
from ckptd.lifecycle.scrub import ChunkSource, damaged_steps, replica_store, store_source
from ckptd.lifecycle.service import GcRun, LifecycleService, LifecycleSettings, ScrubRun
from ckptd.lifecycle.tags import read_tags, remove_tag
from ckptd.repository import Repository
from ckptd.server.auth import ADMIN, READ, STORE_ADMIN, STORE_READ, WRITE, scope
from ckptd.server.deps import JobDep, RepoDep
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute
from ckptd.server.scrub_peers import peer_source
from ckptd.server.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(
    prefix="/v1",
    tags=["lifecycle"],
    route_class=ApiRoute,
    responses=error_responses(400, 401, 500),
)


def _service(request: Request) -> LifecycleService:
    service: LifecycleService = request.app.state.lifecycle
    return service


ServiceDep = Annotated[LifecycleService, Depends(_service)]

# (Bounds checked by ``check_grace``, whose 400 says them, not by the query's schema.)
_GRACE = f"Grace period (s), from 0 to {MAX_GRACE:.0f} (7 days)."


@router.post(
    "/gc",
    dependencies=scope(STORE_ADMIN),
    response_model=GcResult, summary="Collect garbage chunks (or list them)",
    responses=error_responses(503),
)
async def collect(
    service: ServiceDep,
    dry_run: Annotated[bool, Query(description="List what would go; delete nothing.")] = False,
    grace: Annotated[float | None, Query(description=_GRACE)] = None,
) -> GcResult:
    return _gc_result(await service.collect(dry_run=dry_run, grace=grace))


@router.post(
    "/gc/runs",
    dependencies=scope(STORE_ADMIN),
    status_code=202,
    response_model=GcRunBody,
    summary="Start a collection in the background (GET /v1/gc follows it)",
)
async def start_collection(
    service: ServiceDep,
    grace: Annotated[float | None, Query(description=_GRACE)] = None,
) -> GcRunBody:
    return _run_body(service.start_collection(grace))


@router.get(
    "/gc",
    dependencies=scope(STORE_READ),
    response_model=GcStatus,
    summary="The store's GC state and this server's last and running collections",
    description="A damaged state is phase `damaged` (a collection rewrites it); a held "
    "lease has `live_until` and a `note` saying whether its collector still renews it.")
async def gc_status(repo: RepoDep, service: ServiceDep) -> GcStatus:
    last = service.last_gc
    return GcStatus(
        state=await gc_state(repo.store),
        last=dataclasses.asdict(last) | {"deleted": len(last.deleted)} if last else None,
        running=_run_body(service.gc_run) if service.gc_run else None,
        last_run=_run_body(service.last_run) if service.last_run else None,
    )


def _gc_result(report: GcReport) -> GcResult:
    return GcResult(**{k: v for k, v in dataclasses.asdict(report).items() if k != "touched"})


def _run_body(run: GcRun) -> GcRunBody:
    return GcRunBody(id=run.id, started_at=run.started_at, grace=run.grace,
                     ended_at=run.ended_at, error=run.error,
                     report=_gc_result(run.report) if run.report is not None else None)


@router.post("/jobs/{job}/forget", dependencies=scope(ADMIN), response_model=ForgetResult,
             summary="Apply the job's retention: forget the steps it does not keep")
async def forget_steps(
    job: JobDep,
    service: ServiceDep,
    dry_run: Annotated[bool, Query(description="Say what would go; change nothing.")] = False,
    keep_last: Annotated[int | None, Query(
        ge=1, description="Replaces the keep_last of the server's retention for this job; "
        "its other rules (keep_every, keep_within, keep_tagged) still hold.")] = None,
    step: Annotated[int | None, Query(
        ge=0, description="Forget this damaged step only (latest too); 400 when intact.")
    ] = None,
) -> ForgetResult:
    from ckptd.lifecycle.retention import rules_of

    if step is not None:
        if keep_last is not None:
            raise InvalidRequest("pass step or keep_last, not both", job=job)
        plan = await service.forget_damaged(job, step, dry_run=dry_run)
        return _forget_result(job, dry_run, plan.forgotten, plan.steps)
    config = service.settings.retention
    policy = config.for_job(job) if config is not None else RetentionPolicy()
    if keep_last is not None:
        policy = dataclasses.replace(policy, keep_last=keep_last)
    if not policy.forgets and policy.abandon_pending_after is None:
        raise InvalidRequest(
            f"no retention rule for {job}: start the server with --retention FILE, or pass "
            f"keep_last (`ckptd forget {job} --keep-last N`)", job=job)
    plan = await service.forget(job, policy, dry_run=dry_run)
    return _forget_result(job, dry_run, plan.forgotten, plan.steps, rules_of(policy))


def _forget_result(job: str, dry_run: bool, forgotten: list[int],
                   steps: Sequence[StepDecision],
                   rules: dict[str, int | float | bool] | None = None) -> ForgetResult:
    return ForgetResult(job=job, dry_run=dry_run, forgotten=forgotten, rules=rules, steps=[
        StepDecisionBody(step=d.step, committed=d.committed, decision=d.decision,
                         reasons=list(d.reasons), kept_by=list(d.kept_by)) for d in steps])


@router.post(
    "/scrub",
    dependencies=scope(STORE_ADMIN),
    response_model=ScrubResult, summary="Re-hash stored chunks, repair")
async def run_scrub(
    service: ServiceDep,
    budget_bytes: Annotated[int | None, Query(ge=0, description="Default: a whole pass.")
                            ] = None,
) -> ScrubResult:
    report = await service.scrub(budget_bytes=budget_bytes)
    return ScrubResult(**dataclasses.asdict(report))


@router.post(
    "/scrub/runs",
    dependencies=scope(STORE_ADMIN),
    status_code=202,
    response_model=ScrubRunBody,
    summary="Start a scrub in the background (GET /v1/scrub follows it)",
)
async def start_scrub(
    service: ServiceDep,
    budget_bytes: Annotated[int | None, Query(ge=0, description="Default: a whole pass.")
                            ] = None,
) -> ScrubRunBody:
    return _scrub_run_body(service.start_scrub(budget_bytes))


@router.get(
    "/scrub",
    dependencies=scope(STORE_READ),
    response_model=ScrubStatus,
    summary="This server's running scrub (how far it is), the last one ended, and its last")
async def scrub_status(service: ServiceDep) -> ScrubStatus:
    last = service.last_scrub
    return ScrubStatus(
        running=_scrub_run_body(service.scrub_run) if service.scrub_run else None,
        last_run=_scrub_run_body(service.last_scrub_run) if service.last_scrub_run else None,
        last=ScrubResult(**dataclasses.asdict(last)) if last is not None else None,
    )


def _scrub_run_body(run: ScrubRun) -> ScrubRunBody:
    return ScrubRunBody(
        id=run.id, started_at=run.started_at, budget_bytes=run.budget_bytes,
        **dataclasses.asdict(run.progress), ended_at=run.ended_at, error=run.error,
        report=ScrubResult(**dataclasses.asdict(run.report)) if run.report is not None else None)


@router.get("/jobs/{job}/tags", dependencies=scope(READ), summary="A job's tags: name -> step")
async def list_tags(job: JobDep, repo: RepoDep) -> dict[str, int]:
    return await read_tags(repo.store, job)


@router.put(
    "/jobs/{job}/tags/{name}",
    dependencies=scope(WRITE),
    summary="Tag a committed step (retention keeps it)",
    responses=error_responses(404, 409, 413, 415),
)
async def put_tag(job: JobDep, name: str, repo: RepoDep,
                  body: Annotated[TagBody, Body()]) -> dict[str, int]:
    await repo.tag(job, name, body.step)  # only committed steps are tagged
    return await read_tags(repo.store, job)


@router.delete(
    "/jobs/{job}/tags/{name}",
    dependencies=scope(ADMIN),
    summary="Remove a tag", responses=error_responses(404))
async def delete_tag(job: JobDep, name: str, repo: RepoDep) -> dict[str, int]:
    if not await remove_tag(repo.store, job, name):
        raise NotFound(f"{job} has no tag {name!r}", job=job, tag=name)
    return await read_tags(repo.store, job)


@router.get(
    "/jobs/{job}/damage",
    dependencies=scope(READ),
    summary="Steps scrub marked damaged: step -> chunk ids")
async def damage(job: JobDep, repo: RepoDep) -> dict[int, list[str]]:
    return await damaged_steps(repo, job)


# How long GET /v1/space waits for the census to take in what changed just before.
SPACE_WAIT = 0.3


@router.get("/space", dependencies=scope(STORE_READ), response_model=SpaceResult,
            summary="Bytes per job, bytes unique to each step, dedup ratio, space left")
async def space(service: ServiceDep) -> SpaceResult:
    # The census keeps this view up to date in the background: the answer waits for
    # a pass that began after the request only briefly, then says how whole it is.
    s = await service.refresh_space(wait=SPACE_WAIT)
    return SpaceResult(
        chunk_bytes=s.chunk_bytes, chunks=s.chunks, free_bytes=s.free_bytes,
        total_bytes=s.total_bytes, taken_at=s.taken_at,
        jobs=[JobSpaceBody(job=j.job, stored_bytes=j.stored_bytes, logical_bytes=j.logical_bytes,
                           dedup_ratio=j.dedup_ratio,
                           steps=[StepSpaceBody(**dataclasses.asdict(x)) for x in j.steps])
              for j in s.jobs],
        damaged=s.damaged, complete=s.complete, uncounted_steps=s.uncounted_steps,
        chunks_listed_at=s.chunks_listed_at, referenced_bytes=s.referenced_bytes,
        referenced_chunks=s.referenced_chunks, unreferenced_chunks=s.unreferenced_chunks,
        unreferenced_bytes=s.unreferenced_bytes, listing_again=s.listing_again)


# -- background tasks, metrics ---------------------------------------------------------


class _LifecycleCollector(Collector):
    """Capacity, GC and scrub gauges from the service's last results."""

    def __init__(self, service: LifecycleService) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.service
        space = s.space
        stored = GaugeMetricFamily("ckptd_job_stored_bytes",
                                   "Distinct chunk bytes a job's committed steps name.",
                                   labels=["job"])
        logical = GaugeMetricFamily("ckptd_job_logical_bytes",
                                    "Bytes of a job's committed steps' state, summed.",
                                    labels=["job"])
        dedup = GaugeMetricFamily("ckptd_job_dedup_ratio",
                                  "Logical bytes / stored bytes of a job.", labels=["job"])
        unique = GaugeMetricFamily("ckptd_step_unique_bytes",
                                   "Bytes only this step names (what forgetting it frees).",
                                   labels=["job", "step"])
        free = GaugeMetricFamily("ckptd_store_free_bytes",
                                 "Space left on the store's file system (absent on S3).")
        chunks = GaugeMetricFamily("ckptd_store_chunk_bytes",
                                   "Bytes of every chunk in the store, garbage included.")
        if space is not None:
            for j in space.jobs:
                stored.add_metric([j.job], j.stored_bytes)
                logical.add_metric([j.job], j.logical_bytes)
                if j.dedup_ratio is not None:
                    dedup.add_metric([j.job], j.dedup_ratio)
                for st in j.steps:
                    unique.add_metric([j.job, str(st.step)], st.unique_bytes)
            if space.free_bytes is not None:
                free.add_metric([], space.free_bytes)
            chunks.add_metric([], space.chunk_bytes)
        yield from (stored, logical, dedup, unique, free, chunks)
        gc = GaugeMetricFamily("ckptd_gc_bytes_freed", "Bytes freed by this server's GC runs.")
        gc.add_metric([], s.gc_bytes_freed)
        yield gc
        if s.last_gc is not None:
            last = GaugeMetricFamily("ckptd_gc_last_seconds", "Time the last GC run took.")
            last.add_metric([], s.last_gc.seconds)
            yield last
            kept = GaugeMetricFamily("ckptd_gc_last_chunks_kept", "Chunks the last GC kept.")
            kept.add_metric([], s.last_gc.chunks_kept)
            yield kept
        corrupt = GaugeMetricFamily("ckptd_scrub_corrupt_chunks",
                                    "Corrupt chunks this server's scrub found.")
        corrupt.add_metric([], s.scrub_corrupt)
        yield corrupt
        damaged = GaugeMetricFamily("ckptd_damaged_steps",
                                    "Committed steps scrub marked damaged, per job.",
                                    labels=["job"])
        for job, steps in (s.last_scrub.damaged.items() if s.last_scrub else ()):
            damaged.add_metric([job], len(steps))
        yield damaged


async def start(app: FastAPI, repository: Repository) -> LifecycleService:
    """Housekeeping, the space guard, and the background tasks of ``ckptd serve``."""
    settings: Settings = app.state.settings
    await remove_stale_temporaries(repository.store, max_upload_s=settings.max_upload_s)
    # (what forget and gc release on a full disk: ckptd/lifecycle/reserve.py)
    await keep_reserve(repository.store)
    repository.space_guard = SpaceGuard(repository.store, min_free_bytes=settings.min_free_bytes,
                                        warn_free_bytes=settings.warn_free_bytes)
    # (never created: Settings checked that it is there, as `ckptd scrub --replica` does)
    replica = replica_store(settings.scrub_replica) if settings.scrub_replica else None
    # Never with the server's token: each job's ranks with that job's peer token
    # (docs/SECURITY.md, "What leaves the server").
    peers = peer_source(app.state.registry, app.state.views, app.state.peer_secret,
                        settings.scrub_peer_timeout)

    def sources() -> Sequence[ChunkSource]:
        found = [peers]
        return [store_source(replica), *found] if replica is not None else found

    service = LifecycleService(repository, LifecycleSettings(
        retention=load_retention(settings.retention) if settings.retention else None,
        gc_interval=settings.gc_interval, gc_grace=settings.gc_grace, gc_lease=settings.gc_lease,
        scrub_interval=settings.scrub_interval, scrub_budget_bytes=settings.scrub_budget_bytes,
        scrub_rate_bytes_per_s=settings.scrub_rate,
    ), sources=sources)
    app.state.metrics.prometheus.register(_LifecycleCollector(service))
    repository.damaged = service.damaged  # (saves never deduplicate against scrub's finds)
    service.on_forgotten += [app.state.views.forget, app.state.tenants.forget]
    if replica is not None:
        service.on_stop.append(replica.close)
    service.start()
    return service

