"""Jobs and their steps: commit, list, latest, verify."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ckptd.api import (
    ChunkDamage,
    CommitRequest,
    CommitResponse,
    JobList,
    JobSummary,
    Latest,
    StepList,
    StepSummary,
    VerifyResult,
)
from ckptd.errors import CheckpointNotFound, CkptdError
from ckptd.format import CommitRecord
from ckptd.repository import VerifyReport
from ckptd.server.auth import ADMIN, READ, WRITE, CallerDep, scope
from ckptd.server.deps import (
    JobDep,
    MetricsDep,
    QueryStepDep,
    RegistryDep,
    RepoDep,
    StepDep,
    ViewsDep,
)
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute

log = logging.getLogger(__name__)

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    route_class=ApiRoute,
    dependencies=scope(READ),
    responses=error_responses(400, 401, 500),
)


@router.get("", response_model=JobList, summary="Every job and its latest committed step")
async def list_jobs(repo: RepoDep, caller: CallerDep) -> JobList:
    names = [n for n in await repo.list_jobs() if caller.may("read", n)]

    async def summary(name: str) -> JobSummary:
        # One job's damaged (or newer-format) ref must not hide the others.
        latest, unreadable = await repo.latest_or_damage(name)
        return JobSummary(job=name, latest=latest, **unreadable)

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
    responses=error_responses(404, 409, 413, 415),
    dependencies=scope(WRITE),
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
    if status.rollback_cleared:  # heartbeat replies stop naming the marker now
        await views.rollback(job, fresh=True)
        registry.add_event(job, "rollback_cleared", step=step)
    return CommitResponse(
        state=status.state,
        job=status.job,
        step=status.step,
        world_size=status.world_size,
        missing_ranks=status.missing_ranks,
        record=status.record,
        latest_moved=status.latest_moved,
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
    # Asking is no restore: the event is added when a rank reads the step (ranks.py).
    registry.note_latest(job, found.step, found.problems)
    return Latest(job=job, step=found.step, problems=found.problems)


@router.post(
    "/{job}/verify",
    response_model=VerifyResult,
    summary="Check refs, commit records and manifests, and re-hash every chunk of one "
    "committed step (or of all)",
    description="With `Accept: application/x-ndjson` the answer streams progress lines "
    '(`{"chunks_checked", "chunks_total", "bytes_checked", "bytes_total"}`) and ends '
    'with `{"report": VerifyResult}`.',
    responses=error_responses(404, 409),
    dependencies=scope(ADMIN),
)
async def verify(
    job: JobDep, repo: RepoDep, step: QueryStepDep, request: Request
) -> Response:
    if "application/x-ndjson" not in request.headers.get("accept", ""):
        return JSONResponse(_result(await repo.verify(job, step)).model_dump(mode="json"))
    lines: asyncio.Queue[bytes | None] = asyncio.Queue()
    counts = {"chunks_checked": 0, "chunks_total": 0, "bytes_checked": 0, "bytes_total": 0}
    last = [0.0]

    def chunk_done(done: int, total: int) -> None:
        counts["chunks_checked"], counts["chunks_total"] = done, total

    def bytes_done(done: int, total: int) -> None:
        counts["bytes_checked"], counts["bytes_total"] = done, total
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or done == total:
            last[0] = now
            lines.put_nowait(json.dumps(counts).encode() + b"\n")

    async def run() -> None:
        # Errors before the first line still become a coded error answer (below);
        # after it, the stream ends with {"error": ...}.
        try:
            report = await repo.verify(job, step, progress=chunk_done, on_bytes=bytes_done)
            final: dict[str, Any] = {"report": _result(report).model_dump(mode="json")}
        except CkptdError as exc:
            final = {"error": exc.to_json()}
        except Exception:  # a bug: said, and the stream still ends (the caller waits on it)
            log.exception("verify of %s failed", job)
            final = {"error": CkptdError("internal server error; see the server log").to_json()}
        lines.put_nowait(json.dumps(final).encode() + b"\n")
        lines.put_nowait(None)

    task = asyncio.create_task(run())

    async def stream() -> AsyncIterator[bytes]:
        try:
            while (line := await lines.get()) is not None:
                yield line
        finally:
            task.cancel()

    return StreamingResponse(stream(), media_type="application/x-ndjson")


# Seconds between two progress lines of a streamed verify.
PROGRESS_EVERY_S = 0.2


def _result(report: VerifyReport) -> VerifyResult:
    return VerifyResult(
        job=report.job,
        steps=report.steps,
        chunks_checked=report.chunks_checked,
        bytes_checked=report.bytes_checked,
        bad_chunks=report.bad_chunks,
        missing_chunks=report.missing_chunks,
        bad_manifests=report.bad_manifests,
        bad_refs=report.bad_refs,
        bad_commits=report.bad_commits,
        damage=[ChunkDamage.model_validate(d) for d in report.damage],
        bytes_total=report.bytes_total,
        unreadable=report.unreadable,
        ok=report.ok,
    )
