"""The dashboard at ``/`` and the JSON view it draws, ``GET /v1/overview``.

The page (a template, a stylesheet and a script; no build step) holds no data, so
it is served without a token. Its script fetches ``/v1/overview``, which needs the
token like every ``/v1`` route: when the server has one, the page asks for it and
keeps it in the tab's sessionStorage. Everything clients sent is drawn as text."""

from __future__ import annotations

import asyncio
import string
from functools import cache
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Response
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

from ckptd import __version__
from ckptd.api import JobView, Overview, StepView, StorageView
from ckptd.errors import JobNotFound, StoreCorrupt, UnsupportedFormat
from ckptd.format import check_job
from ckptd.lifecycle.scrub import damaged_steps
from ckptd.repository import Repository
from ckptd.repository.listings import UNREADABLE, Unreadable
from ckptd.repository.listings import unreadable as unreadable_field
from ckptd.server.auth import READ, READ_ANY, CallerDep, scope
from ckptd.server.deps import MetricsDep, RegistryDep, RepoDep, SettingsDep, ViewsDep
from ckptd.server.metrics import Totals
from ckptd.server.registry import Registry, StoreViews
from ckptd.server.routes import error_responses
from ckptd.server.routes.coordination import event_body
from ckptd.server.routes.ranks import rank_status
from ckptd.server.routing import ApiRoute

HERE = Path(__file__).parent
REFRESH_S = 3
EVENTS_SHOWN = 50

# No inline script or style, nothing from elsewhere, no framing.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

page_router = APIRouter(tags=["dashboard"])
api_router = APIRouter(
    prefix="/v1",
    tags=["dashboard"],
    route_class=ApiRoute,
    dependencies=scope(READ_ANY),
    responses=error_responses(400, 401, 500),
)


@cache
def _page() -> str:
    template = string.Template((HERE / "templates" / "dashboard.html").read_text("utf-8"))
    return template.substitute(
        version=__version__, refresh_ms=REFRESH_S * 1000, refresh_s=REFRESH_S
    )


@page_router.get("/", response_class=HTMLResponse, summary="The dashboard (HTML)")
async def dashboard() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})


async def job_view(
    job: str, repo: Repository, registry: Registry, views: StoreViews, steps: int
) -> JobView:
    world, ranks = registry.ranks(job)
    latest = await views.latest(job)  # (a damaged ref reads as None there)
    unreadable: Unreadable = {}
    if latest is None:  # no step yet, or a ref this ckptd cannot read: say which
        _, unreadable = await repo.latest_or_damage(job)
    target = registry.pending_target(job, latest)
    rollback = await views.rollback(job)
    numbers = (await repo.step_numbers(job))[-steps:] if steps else []
    damaged = set(await damaged_steps(repo, job))
    shown: list[StepView] = []
    for step in numbers:
        try:
            record = await views.commit(job, step)
        except UNREADABLE as exc:  # shown as damaged; the page keeps every other job
            shown.append(StepView(
                step=step, committed=False, world_size=world, ranks_present=0,
                logical_bytes=None, committed_at=None, is_latest=False, reason=None,
                requested_by=None, **unreadable_field(exc),
            ))
            continue
        if record is not None:
            reason = record.meta.get("reason")
            by = record.meta.get("requested_by")
            shown.append(
                StepView(
                    step=step,
                    committed=True,
                    world_size=record.world_size,
                    ranks_present=record.world_size,
                    logical_bytes=record.report.logical_bytes,
                    committed_at=record.committed_at,
                    is_latest=step == latest,
                    reason=str(reason) if reason is not None else "periodic",
                    requested_by=by if isinstance(by, int) and not isinstance(by, bool) else None,
                    damaged=("scrub found corrupt chunks; restore of latest skips it"
                             if step in damaged else None),
                )
            )
            world = world if world is not None else record.world_size
        else:
            present = await repo.ranks_present(job, step)
            shown.append(
                StepView(
                    step=step,
                    committed=False,
                    world_size=world,
                    ranks_present=len(present),
                    logical_bytes=None,
                    committed_at=None,
                    is_latest=False,
                    reason=None,
                    requested_by=None,
                )
            )
    return JobView(
        job=job,
        latest=latest,
        world_size=world,
        snapshot_at=target.step if target is not None else None,
        snapshot_reason=target.reason if target is not None else None,
        rollback_to=rollback.step if rollback is not None else None,
        ranks=[rank_status(v) for v in ranks],
        steps=shown,
        events=[event_body(e) for e in registry.events(job)[-EVENTS_SHOWN:]],
        damaged_steps=sorted(damaged),
        rebuilding=registry.rebuilding(job),
        **unreadable,
    )


def _unreadable_view(job: str, exc: StoreCorrupt | UnsupportedFormat) -> JobView:
    """A job the overview could not read at all, shown as damaged (or newer)."""
    return JobView(job=job, latest=None, world_size=None, snapshot_at=None,
                   snapshot_reason=None, rollback_to=None, ranks=[], steps=[], events=[],
                   **unreadable_field(exc))


@api_router.get(
    "/overview",
    response_model=Overview,
    summary="Every job with its ranks, newest steps and events, and storage counters",
    responses=error_responses(404),
)
async def overview(
    repo: RepoDep,
    registry: RegistryDep,
    views: ViewsDep,
    metrics: MetricsDep,
    settings: SettingsDep,
    caller: CallerDep,
    job: Annotated[str | None, Query(description="Only this job.")] = None,
    steps: Annotated[int, Query(ge=0, le=1000, description="Newest steps per job.")] = 20,
) -> Overview:
    if job is not None:
        names = [check_job(job)]
        READ.check(caller, job)
    else:
        every = set(await repo.list_jobs()) | set(registry.jobs())
        names = sorted(n for n in every if caller.may("read", n))
    sem = asyncio.Semaphore(8)

    async def one(name: str) -> JobView:
        async with sem:
            try:
                return await job_view(name, repo, registry, views, steps)
            except UNREADABLE as exc:  # one job's documents must not hide the others
                return _unreadable_view(name, exc)

    jobs = list(await asyncio.gather(*(one(n) for n in names)))
    if job is not None and _nothing_of(jobs[0]) and job not in registry.jobs() and (
            job not in await repo.list_jobs()):
        raise JobNotFound(f"no job {job!r} on this server (GET /v1/jobs lists them)", job=job)
    # Where the store is and what every tenant did are the operator's to see.
    t = metrics.totals if caller.every_job else Totals(since=metrics.totals.since)
    return Overview(
        version=__version__,
        store=repo.store.describe() if caller.every_job else "",
        interval_s=settings.heartbeat_interval,
        dead_after_s=settings.heartbeat_interval * settings.dead_after,
        storage=StorageView(
            since=t.since,
            chunks_stored=t.chunks_stored,
            bytes_stored=t.bytes_stored,
            chunks_offered=t.chunks_offered,
            chunks_missing=t.chunks_missing,
            dedup_ratio=t.dedup_ratio,
            uploads=t.uploads,
            upload_bytes=t.upload_bytes,
            restores=t.restores,
            restore_bytes=t.restore_bytes,
            commits=t.commits,
            rejected_uploads=t.rejected_uploads,
        ),
        jobs=jobs,
    )


def _nothing_of(view: JobView) -> bool:
    """Whether a job's view holds nothing: one the store lacks and no rank spoke of,
    or one whose steps were all asked away (``steps=0``; the store then says)."""
    return (view.latest is None and not view.steps and not view.ranks and not view.events
            and view.damaged is None and view.unsupported is None)


class _StaticFiles(StaticFiles):
    """The page's script and stylesheet, with the page's security headers."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def install_dashboard(app: FastAPI) -> None:
    """The page, its static files and the overview route. (No middleware: an HTTP
    middleware would sit in the path of every chunk upload and download.)"""
    app.include_router(page_router)
    app.include_router(api_router)
    app.mount("/static", _StaticFiles(directory=HERE / "static"), name="static")
