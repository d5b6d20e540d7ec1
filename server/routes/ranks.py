"""Ranks: heartbeats, liveness, and restore plans (soft state, see registry.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ckptd.api import (
    HealthReport,
    HeartbeatReply,
    HeartbeatRequest,
    RankList,
    RankStatus,
    RestorePlan,
    StepPlan,
)
from ckptd.errors import CkptdError, ManifestHashMismatch, ManifestNotFound, StoreCorrupt
from ckptd.format import CommitRecord, RankManifest, check_rank
from ckptd.repository import Repository
from ckptd.repository.reads import committed_rank
from ckptd.server.auth import READ, WRITE, peer_token, scope
from ckptd.server.deps import (
    JobDep,
    MetricsDep,
    QueryRankDep,
    QueryStepDep,
    RankDep,
    RegistryDep,
    RepoDep,
    SettingsDep,
    ViewsDep,
)
from ckptd.server.peering import refuse_peer_url
from ckptd.server.presign import chunk_reads
from ckptd.server.registry import RankView, Registry, StoreViews
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute

log = logging.getLogger(__name__)

router = APIRouter(
    prefix="/v1/jobs",
    tags=["ranks"],
    route_class=ApiRoute,
    dependencies=scope(READ),
    responses=error_responses(400, 401, 500),
)

# Peer manifests read at once for one restore plan.
PLAN_READS = 16
# A refused peer_url is logged once per (job, rank, reason), then at most this often:
# every heartbeat brings it again (47 lines in 18 s for 4 ranks).
REFUSED_LOG_EVERY_S = 300.0
_REFUSED_KEPT = 4096
_refused_said: dict[tuple[str, int, str], float] = {}


def _say_refused(job: str, rank: int, url: str, reason: str) -> None:
    now = time.monotonic()
    key = (job, rank, reason)
    said = _refused_said.get(key)
    if said is not None and now - said < REFUSED_LOG_EVERY_S:
        log.debug("%s/%d: peer_url %r not registered: %s", job, rank, url[:200], reason)
        return
    if said is None and len(_refused_said) >= _REFUSED_KEPT:
        del _refused_said[next(iter(_refused_said))]  # the oldest said
    _refused_said.pop(key, None)
    _refused_said[key] = now
    log.warning("%s/%d: peer_url %r not registered: %s (said again at most every %g s)",
                job, rank, url[:200], reason, REFUSED_LOG_EVERY_S)


def rank_status(view: RankView) -> RankStatus:
    return RankStatus(
        rank=view.rank,
        state=view.state,
        step=view.step,
        held_step=view.held_step,
        peer_url=view.peer_url,
        last_heartbeat=view.last_heartbeat,
        age_s=view.age_s,
        health=HealthReport.model_validate(view.health),
        rtt_ms=view.rtt_ms,
    )


@router.post(
    "/{job}/ranks/{rank}/heartbeat",
    response_model=HeartbeatReply,
    summary="A rank is alive: its step, held step, peer URL and health",
    responses=error_responses(413, 415),
    dependencies=scope(WRITE),
)
async def heartbeat(
    job: JobDep,
    rank: RankDep,
    body: HeartbeatRequest,
    registry: RegistryDep,
    views: ViewsDep,
    metrics: MetricsDep,
    settings: SettingsDep,
    request: Request,
) -> HeartbeatReply:
    check_rank(rank, body.world_size, job=job)
    refused = None
    source = request.client.host if request.client is not None else None
    if body.peer_url is not None and not settings.any_peer_url:
        refused = refuse_peer_url(body.peer_url, source, settings.peer_network_list())
        if refused is not None:
            _say_refused(job, rank, body.peer_url, refused)
    conflict = registry.heartbeat(
        job,
        rank,
        world_size=body.world_size,
        epoch=await views.epoch(job),
        peer_url=body.peer_url if refused is None else None,
        step=body.step,
        held_step=body.held_step,
        health=body.health.model_dump(),
        rtt_ms=body.rtt_ms,
        launch=body.launch,
        host=source,
    )
    metrics.heartbeat()
    # The store is read only while a target is pending (to see it committed), and
    # the rollback marker at most once per interval per job (StoreViews).
    latest = await views.latest(job) if registry.has_target(job) else None
    target = registry.pending_target(job, latest)
    rollback = await views.rollback(job)
    return HeartbeatReply(
        interval_s=settings.heartbeat_interval,
        snapshot_at=target.step if target is not None else None,
        snapshot_reason=target.reason if target is not None else None,
        rollback_to=rollback.step if rollback is not None else None,
        rollback_epoch=await views.epoch(job),
        peer_token=peer_token(request.app.state.peer_secret, job),
        peer_url_refused=refused,
        launch_conflict=conflict,
    )


@router.delete(
    "/{job}/ranks/{rank}/heartbeat",
    status_code=204,
    response_class=Response,
    summary="A rank says goodbye: it closed cleanly, so it shows as left, not dead",
    dependencies=scope(WRITE),  # as the heartbeat: a reader must not mark ranks left
)
async def goodbye(job: JobDep, rank: RankDep, registry: RegistryDep) -> Response:
    registry.goodbye(job, rank)
    return Response(status_code=204)


@router.get(
    "/{job}/ranks",
    response_model=RankList,
    summary="Every rank of a job that has sent heartbeats, with its state",
)
async def list_ranks(job: JobDep, registry: RegistryDep, views: ViewsDep) -> RankList:
    world, ranks = registry.ranks(job)
    latest = await views.latest(job)
    target = registry.pending_target(job, latest)
    rollback = await views.rollback(job)
    return RankList(
        job=job,
        world_size=world,
        ranks=[rank_status(v) for v in ranks],
        latest=latest,
        snapshot_at=target.step if target is not None else None,
        rollback_to=rollback.step if rollback is not None else None,
        rebuilding=registry.rebuilding(job),
    )


# What makes a committed step unusable for a plan: a manifest missing or damaged.
_DAMAGE = (ManifestHashMismatch, ManifestNotFound, StoreCorrupt)


async def _committed(
    job: str, asked: int | None, repo: Repository, views: StoreViews
) -> tuple[int, CommitRecord, list[str]]:
    """The step a plan is for (``asked``, else the newest restorable one), its commit
    record, and the damaged documents that made "latest" an older step."""
    fallback: list[str] = []
    if asked is not None:
        step = asked
    else:
        found = await repo.restorable_step(job)  # falls back past a damaged latest
        fallback = list(found.problems)
        step = found.step if found.step is not None else await repo.resolve_step(job, None)
    record = await views.commit(job, step)
    if record is None:
        record = await repo.read_commit(job, step)  # raises not_committed / not found
    return step, record, fallback


def _restoring(registry: Registry, job: str, asked: int | None, step: int,
               fallback: list[str], rank: int) -> None:
    """A plan for ``rank`` to restore ``step``: a ``restore_fallback`` event when
    that is an older step than latest, past damage (chosen here, or by ``GET
    latest`` before the plan was asked for it)."""
    if asked is None:
        registry.note_latest(job, step, fallback)
    registry.restoring(job, step, rank)


@router.get(
    "/{job}/restore-plan",
    response_class=Response,
    summary="Rank R's manifest of a committed step, the live peers holding its chunks, and "
    "over an object store presigned URLs to read them from it",
    responses={
        200: {"model": RestorePlan, "description": "The plan"},
        **error_responses(404, 409, 422),
    },
)
async def restore_plan(
    job: JobDep,
    repo: RepoDep,
    registry: RegistryDep,
    views: ViewsDep,
    request: Request,
    rank: QueryRankDep,
    asked: QueryStepDep,
    settings: SettingsDep,
) -> Response:
    step, record, fallback = await _committed(job, asked, repo, views)
    committed_rank(record, rank)  # (a caller's rank past the world: 404, never damage)
    try:
        manifest = await repo.read_manifest(job, step, rank)
    except _DAMAGE:
        if asked is not None or not repo.recheck_manifests(job, step):
            raise
        # Damaged since "latest" was last checked: chosen again, it falls back.
        step, record, fallback = await _committed(job, asked, repo, views)
        manifest = await repo.read_manifest(job, step, rank)
    _restoring(registry, job, asked, step, fallback, rank)
    holders = [
        (peer, url)
        for peer, url in registry.peers_holding(job, step, exclude=rank)
        if peer < record.world_size
    ]
    sem = asyncio.Semaphore(PLAN_READS)

    async def held_ids(peer: int) -> frozenset[str]:
        async with sem:
            try:
                ids: frozenset[str] = await views.chunk_ids(job, step, peer)
                return ids
            except CkptdError as exc:  # one bad peer manifest must not sink the plan
                log.warning("%s step %d: no peer ids of rank %d: %s", job, step, peer, exc)
                return frozenset()

    held = await asyncio.gather(*(held_ids(peer) for peer, _ in holders))
    urls = [url for _, url in holders]
    token = peer_token(request.app.state.peer_secret, job)
    # Over an object store: the rank reads its own manifest's chunks from it directly.
    direct = await chunk_reads(repo.store, settings, manifest.chunk_ids())

    def encode() -> bytes:
        # Set intersections (C speed) rather than a lookup per chunk and peer: a
        # world of thousands of ranks has thousands of holders.
        peers: dict[str, list[str]] = {
            cid: [] for entry in manifest.entries for cid in entry.chunks
        }
        wanted = peers.keys()
        for url, ids in zip(urls, held, strict=True):
            for cid in wanted & ids:
                peers[cid].append(url)
        plan: dict[str, Any] = {
            "job": job,
            "step": step,
            "rank": rank,
            "world_size": record.world_size,
            "manifest": None,
            "manifest_hash": record.manifests[rank].hash,
            "peers": peers,
            "peer_token": token,
        }
        if direct is not None:
            plan["reads"], plan["reads_expire_in"] = direct
        # The manifest's canonical bytes (kept since it was parsed) are its JSON:
        # spliced in, not encoded again (seconds for 100,000 tensors).
        head = json.dumps(plan, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return head.replace(b'"manifest":null', b'"manifest":' + manifest.canonical(), 1)

    # A large manifest is CPU work: off the event loop.
    data = await asyncio.to_thread(encode)
    return Response(data, media_type="application/json")


@router.get(
    "/{job}/step-plan",
    response_class=Response,
    summary="Every rank's manifest of a committed step and the live peers holding it, "
    "in one answer (a load into any world size: DCP's Reader)",
    responses={
        200: {"model": StepPlan, "description": "The plan"},
        **error_responses(404, 409, 422),
    },
)
async def step_plan(
    job: JobDep,
    repo: RepoDep,
    registry: RegistryDep,
    views: ViewsDep,
    request: Request,
    rank: QueryRankDep,
    asked: QueryStepDep,
) -> Response:
    step, record, fallback = await _committed(job, asked, repo, views)
    sem = asyncio.Semaphore(PLAN_READS)

    async def manifest(r: int) -> bytes:
        async with sem:
            manifest: RankManifest = await repo.read_manifest(job, step, r)
            return manifest.canonical()

    # A damaged manifest fails the plan with its typed error: a load needs them all.
    try:
        manifests = await asyncio.gather(*(manifest(r) for r in range(record.world_size)))
    except _DAMAGE:
        if asked is not None or not repo.recheck_manifests(job, step):
            raise
        # Damaged since "latest" was last checked: chosen again, it falls back.
        step, record, fallback = await _committed(job, asked, repo, views)
        manifests = await asyncio.gather(*(manifest(r) for r in range(record.world_size)))
    _restoring(registry, job, asked, step, fallback, rank)
    holders = [{"rank": peer, "url": url}
               for peer, url in registry.peers_holding(job, step, exclude=rank)
               if peer < record.world_size]

    def encode() -> bytes:
        plan: dict[str, Any] = {
            "job": job,
            "step": step,
            "world_size": record.world_size,
            "holders": holders,
            "peer_token": peer_token(request.app.state.peer_secret, job),
            "fallback": fallback,
            "commit": None,
            "manifests": None,
        }
        # The documents' canonical bytes are their JSON: spliced in, not encoded again.
        head = json.dumps(plan, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        head = head.replace(b'"commit":null', b'"commit":' + record.canonical(), 1)
        return head.replace(b'"manifests":null', b'"manifests":[' + b",".join(manifests) + b"]",
                            1)

    data = await asyncio.to_thread(encode)
    return Response(data, media_type="application/json")
