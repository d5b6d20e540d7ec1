"""Dependencies of the routes, as ``Annotated`` aliases.

Names in the URL are checked with ``ckptd.format``'s ``check_*`` functions (an
``InvalidName``, 400, when they do not match), so the server has no rules of its
own about what a job, step, rank or chunk id may be."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request

from ckptd.format import (
    CHUNK_ID_RE,
    JOB_RE,
    MAX_WORLD_SIZE,
    RANK_PATTERN,
    STEP_PATTERN,
    check_chunk_id,
    check_job,
    check_rank,
    check_step,
)
from ckptd.repository import Repository
from ckptd.server.auth import require_token
from ckptd.server.metrics import Metrics
from ckptd.server.registry import Registry, StoreViews
from ckptd.server.settings import Settings
from ckptd.server.tenancy import TenantChunks


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_repository(request: Request) -> Repository:
    repo: Repository = request.app.state.repository
    return repo


async def get_registry(request: Request) -> Registry:
    registry: Registry = request.app.state.registry
    return registry


async def get_views(request: Request) -> StoreViews:
    views: StoreViews = request.app.state.views
    return views


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def get_tenants(request: Request) -> TenantChunks:
    tenants: TenantChunks = request.app.state.tenants
    return tenants


SettingsDep = Annotated[Settings, Depends(get_settings)]
RepoDep = Annotated[Repository, Depends(get_repository)]
RegistryDep = Annotated[Registry, Depends(get_registry)]
ViewsDep = Annotated[StoreViews, Depends(get_views)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
TenantsDep = Annotated[TenantChunks, Depends(get_tenants)]
AuthDep = Annotated[None, Depends(require_token)]


# The patterns are in the OpenAPI document, so a schema-driven client never sends a
# name the server refuses; "01" is not step 1 (one spelling per number).


async def _job(
    job: Annotated[
        str,
        Path(description="Job name: letters, digits, '.', '_', '-'.", pattern=JOB_RE.pattern),
    ],
) -> str:
    return check_job(job)


async def _step(
    step: Annotated[str, Path(description="Training step, in [0, 10^15).", pattern=STEP_PATTERN)],
) -> int:
    return check_step(int(step))


async def _rank(rank: Annotated[str, Path(description="Rank, >= 0.", pattern=RANK_PATTERN)]) -> int:
    # The world size is the manifest's to say; no world is larger than this.
    return check_rank(int(rank), MAX_WORLD_SIZE)


async def _chunk_id(
    cid: Annotated[
        str,
        Path(alias="id", description="blake3 of the chunk, 64 lowercase hex.",
             pattern=CHUNK_ID_RE.pattern),
    ],
) -> str:
    return check_chunk_id(cid)


JobDep = Annotated[str, Depends(_job)]
StepDep = Annotated[int, Depends(_step)]
RankDep = Annotated[int, Depends(_rank)]
ChunkIdDep = Annotated[str, Depends(_chunk_id)]


async def _query_step(
    step: Annotated[
        str | None,
        Query(description="A step; default the latest (or every one).", pattern=STEP_PATTERN),
    ] = None,
) -> int | None:
    return check_step(int(step)) if step is not None else None


async def _query_rank(
    rank: Annotated[str, Query(description="The restoring rank.", pattern=RANK_PATTERN)],
) -> int:
    return check_rank(int(rank), MAX_WORLD_SIZE)


QueryStepDep = Annotated[int | None, Depends(_query_step)]
QueryRankDep = Annotated[int, Depends(_query_rank)]
