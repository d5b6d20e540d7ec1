"""Coordination of a job's ranks: coordinated snapshots, rollback, the event log."""

from __future__ import annotations

from fastapi import APIRouter

from ckptd.api import (
    EventBody,
    EventList,
    RollbackReply,
    RollbackRequest,
    SnapshotReply,
    SnapshotRequest,
)
from ckptd.server.auth import READ, WRITE, scope
from ckptd.server.deps import JobDep, MetricsDep, RegistryDep, RepoDep, ViewsDep
from ckptd.server.registry import Event
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute

router = APIRouter(
    prefix="/v1/jobs",
    tags=["coordination"],
    route_class=ApiRoute,
    dependencies=scope(READ),
    responses=error_responses(400, 401, 500),
)


def event_body(event: Event) -> EventBody:
    return EventBody(**event.to_json())


@router.post(
    "/{job}/snapshot-requests",
    response_model=SnapshotReply,
    summary="Ask every rank to snapshot a little ahead of the fastest live rank",
    responses=error_responses(413, 415),
    dependencies=scope(WRITE),
)
async def request_snapshot(
    job: JobDep,
    body: SnapshotRequest,
    registry: RegistryDep,
    views: ViewsDep,
    metrics: MetricsDep,
) -> SnapshotReply:
    latest = await views.latest(job, fresh=True)
    decision = registry.request_snapshot(job, body.rank, body.reason, latest,
                                          pace=body.step_time_s)
    metrics.snapshot_requested(decision.accepted)
    return SnapshotReply(
        snapshot_at=decision.step, reason=decision.reason, accepted=decision.accepted
    )


@router.post(
    "/{job}/rollback",
    response_model=RollbackReply,
    summary="Mark the job to go back to a committed step (durable, a ref in the store)",
    responses=error_responses(404, 409, 413, 415),
    dependencies=scope(WRITE),
)
async def set_rollback(
    job: JobDep, body: RollbackRequest, repo: RepoDep, registry: RegistryDep, views: ViewsDep
) -> RollbackReply:
    done = await repo.set_rollback(job, body.step, from_epoch=body.from_epoch)
    if done.started:  # before any reply names the marker: never both in one reply
        registry.drop_target(job, f"the job rolled back to step {done.marker.step}")
    views.set_rollback(job, done.marker, done.epoch)
    if done.started:  # not a second rank asking for the rollback already set
        registry.add_event(job, "rollback_set", step=done.marker.step, reason=body.reason)
    return RollbackReply(rollback_to=done.marker.step, epoch=done.epoch)


@router.get(
    "/{job}/rollback",
    response_model=RollbackReply,
    summary="The job's rollback marker (if any) and its timeline",
)
async def read_rollback(job: JobDep, repo: RepoDep) -> RollbackReply:
    ref, epoch = await repo.rollback_state(job)
    return RollbackReply(rollback_to=ref.step if ref is not None else None, epoch=epoch)


@router.delete(
    "/{job}/rollback",
    response_model=RollbackReply,
    summary="Clear the job's rollback marker",
    dependencies=scope(WRITE),
)
async def clear_rollback(
    job: JobDep, repo: RepoDep, registry: RegistryDep, views: ViewsDep
) -> RollbackReply:
    if await repo.clear_rollback(job):
        registry.add_event(job, "rollback_cleared")
    epoch = await repo.epoch(job)
    views.set_rollback(job, None, epoch)
    return RollbackReply(rollback_to=None, epoch=epoch)


@router.get(
    "/{job}/events",
    response_model=EventList,
    summary="What happened to a job lately (snapshot requests, rollbacks, dead ranks)",
)
async def list_events(job: JobDep, registry: RegistryDep) -> EventList:
    registry.ranks(job)  # notices ranks that died since anyone last looked
    return EventList(job=job, events=[event_body(e) for e in registry.events(job)])
