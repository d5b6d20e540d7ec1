"""Jobs and their steps: commit, list, latest, verify."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated

from fastapi import APIRouter, Body, Depends

from ckptd.errors import CheckpointNotFound, StoreCorrupt
from ckptd.format import CommitRecord
from ckptd.server.auth import require_token
from ckptd.server.deps import (
    JobDep,
    MetricsDep,
    QueryStepDep,
    RegistryDep,
    RepoDep,
    StepDep,
    ViewsDep,
)
from ckptd.server.models import (
    CommitRequest,
    CommitResponse,
    JobList,
    JobSummary,
    Latest,
    StepList,
    StepSummary,
    VerifyResult,
)
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    route_class=ApiRoute,
    dependencies=[Depends(require_token)],
    responses=error_responses(400, 401, 500),
)


@router.get("", response_model=JobList, summary="Every job and its latest committed step")
async def list_jobs(repo: RepoDep) -> JobList:
    names = await repo.list_jobs()

    async def summary(name: str) -> JobSummary:
        try:
            return JobSummary(job=name, latest=await repo.latest(name))
        except StoreCorrupt as exc:  # one job's damaged ref must not hide the others
            return JobSummary(job=name, latest=None, damaged=exc.message)

    return JobList(jobs=list(await asyncio.gather(*(summary(n) for n in names))))


@router.get("/{job}/steps", response_model=StepList, summary="A job's steps, committed or not")
async def list_steps(job: JobDep, repo: RepoDep) -> StepList:
    infos = await repo.list_steps(job)
    # Taken from the same listing, so "latest" and "is_latest" always agree.
    latest = next((info.step for info in infos if info.is_latest), None)
    return StepList(
        job=job,
        latest=latest,
        steps=[StepSummary(**dataclasses.asdict(info)) for info in infos],
    )


@router.get(
    "/{job}/steps/{step}",
    response_model=CommitRecord,
    summary="The commit record of a committed step",
    responses=error_responses(404, 409),
)
async def read_commit(job: JobDep, step: StepDep, repo: RepoDep) -> CommitRecord:
    record: CommitRecord = await repo.read_commit(job, step)
    return record


@router.post(
    "/{job}/steps/{step}/commit",
    response_model=CommitResponse,
    summary="Commit a step once all its ranks' manifests are in and agree",
    responses=error_responses(404, 409),
)
async def commit(
    job: JobDep,
    step: StepDep,
    repo: RepoDep,
    registry: RegistryDep,
    views: ViewsDep,
    metrics: MetricsDep,
    body: Annotated[CommitRequest | None, Body()] = None,
) -> CommitResponse:
    status = await repo.commit(job, step, meta=body.meta if body is not None else None)
    if status.record is not None:
        registry.note_commit(job, step)  # a coordinated snapshot at or before it is done
        views.note_commit(job, step)
        metrics.committed(
            job, step, status.record.committed_at, status.record.meta.get("reason")
        )
    return CommitResponse(
        state=status.state,
        job=status.job,
        step=status.step,
        world_size=status.world_size,
        missing_ranks=status.missing_ranks,
        record=status.record,
    )


@router.get(
    "/{job}/latest",
    response_model=Latest,
    summary="The newest committed step of a job",
    responses=error_responses(404),
)
async def latest(job: JobDep, repo: RepoDep, registry: RegistryDep) -> Latest:
    found = await repo.restorable_step(job)
    if found.step is None:
        raise CheckpointNotFound(
            f"job {job} has no usable committed checkpoint"
            + (f" ({'; '.join(found.problems)})" if found.problems else ""),
            job=job, problems=found.problems,
        )
    if found.problems:
        registry.add_event(job, "restore_fallback", step=found.step,
                           reason="; ".join(found.problems)[:1024])
    return Latest(job=job, step=found.step, problems=found.problems)


@router.post(
    "/{job}/verify",
    response_model=VerifyResult,
    summary="Re-hash every chunk of one committed step, or of every committed step",
    responses=error_responses(404, 409),
)
async def verify(
    job: JobDep,
    repo: RepoDep,
    step: QueryStepDep,
) -> VerifyResult:
    report = await repo.verify(job, step)
    return VerifyResult(
        job=report.job,
        steps=report.steps,
        chunks_checked=report.chunks_checked,
        bytes_checked=report.bytes_checked,
        bad_chunks=report.bad_chunks,
        missing_chunks=report.missing_chunks,
        bad_manifests=report.bad_manifests,
        ok=report.ok,
    )
