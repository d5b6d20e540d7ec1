"""Rank manifests: what one rank holds at one step."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from ckptd import knobs
from ckptd.api import ManifestStored
from ckptd.cluster import chunk_key, rank_members
from ckptd.errors import InvalidRequest
from ckptd.format import RankManifest
from ckptd.hashing import document_hash
from ckptd.repository.protocol import manifest_lacks
from ckptd.server.auth import READ, WRITE, scope
from ckptd.server.bodies import (
    check_json_type,
    declared_body_bytes,
    ingest_budget,
    read_body,
)
from ckptd.server.cluster import Membership
from ckptd.server.deps import (
    JobDep,
    MetricsDep,
    RankDep,
    RegistryDep,
    RepoDep,
    StepDep,
    TenantsDep,
)
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute
from ckptd.server.tenancy import TenantChunks
from ckptd.tokens import Grant

router = APIRouter(
    prefix="/v1/jobs",
    tags=["manifests"],
    route_class=ApiRoute,
    dependencies=scope(READ),
    responses=error_responses(400, 401, 500),
)

MANIFEST_HASH_HEADER = "X-Ckptd-Manifest-Hash"


@router.put(
    "/{job}/steps/{step}/ranks/{rank}",
    status_code=201,
    response_model=ManifestStored,
    summary="Put a rank's manifest, once every chunk it names is stored",
    responses=error_responses(409, 413, 415),
    dependencies=scope(WRITE),
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "A rank manifest (docs/FORMAT.md) whose job, step and rank are "
            "the path's.",
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/RankManifest"}}
            },
        }
    },
)
async def put_manifest(
    job: JobDep, step: StepDep, rank: RankDep, request: Request, repo: RepoDep,
    metrics: MetricsDep, tenants: TenantsDep,
) -> ManifestStored:
    check_json_type(request, required=False)  # (one sent with no type is read as JSON)
    limit = knobs.max_manifest_bytes()
    # Its bytes count in the uploads' budget, as a chunk's do, from before a buffer
    # exists until they are parsed: 16 manifests of 48 MiB pinned 768 MiB outside it.
    async with ingest_budget(request).hold(declared_body_bytes(request, limit)):
        data = await read_body(request, limit, "manifest")
        # Parsing a large manifest is CPU work: kept off the event loop.
        manifest = await repo.parse_manifest(data)
        del data
    if (manifest.job, manifest.step, manifest.rank) != (job, step, rank):
        raise InvalidRequest(
            f"the manifest is of job {manifest.job!r} step {manifest.step} rank "
            f"{manifest.rank}, the path names job {job!r} step {step} rank {rank}",
        )
    grant: Grant = request.state.caller
    tenant = not (grant.every_job and grant.may("read", None))  # it acts for ``job``
    if tenant:
        ids = await _refuse_unknown_chunks(manifest, job, tenants,
                                           request.app.state.membership)
    digest = await repo.put_manifest(manifest)
    if tenant:
        tenants.named(job, step, ids)  # (the ids held as its upload are the step's now)
    metrics.manifest_stored()
    return ManifestStored(hash=digest)


@router.get(
    "/{job}/steps/{step}/ranks/{rank}",
    response_class=Response,
    summary="A rank's manifest of a committed step, in its canonical bytes",
    responses={
        200: {
            "model": RankManifest,
            "description": "The manifest's canonical JSON",
            "headers": {
                MANIFEST_HASH_HEADER: {
                    "description": "blake3 of the body, as named in the commit record",
                    "schema": {"type": "string"},
                }
            },
        },
        **error_responses(404, 409, 422),
    },
)
async def get_manifest(job: JobDep, step: StepDep, rank: RankDep, repo: RepoDep,
                       registry: RegistryDep) -> Response:
    manifest = await repo.read_manifest(job, step, rank)
    registry.restoring(job, step, rank)  # (a restore without a plan reads it here)
    data = manifest.canonical()  # (kept since it was parsed)
    return Response(
        data, media_type="application/json", headers={MANIFEST_HASH_HEADER: document_hash(data)}
    )


async def _refuse_unknown_chunks(manifest: RankManifest, job: str, tenants: TenantChunks,
                                 membership: Membership) -> list[str]:
    """A scoped caller's manifest may name only chunks its job may know of
    (``TenantChunks``: uploaded by it, or named by its committed steps), else a
    chunk id learnt elsewhere would let it commit a step naming another tenant's
    chunk and then read it, and the answer would tell whether the store holds it.
    An unknown chunk is refused as one the store lacks (the same answer, whether
    stored or not); the caller sends its bytes. With replicas, a chunk another
    replica is home of was uploaded there, where this one cannot see it: only
    those this replica is home of are checked (docs/design/006-tenants.md). The
    manifest's ids, sorted."""
    ids = await asyncio.to_thread(lambda: sorted(manifest.chunk_ids()))
    known = await tenants.known(job, ids)
    unknown = [cid for cid in ids if cid not in known]
    if unknown and membership.mode != "single":
        urls = [m.url for m in await membership.members()]
        if len(urls) > 1:
            unknown = [cid for cid in unknown
                       if rank_members(chunk_key(cid), urls)[0] == membership.self_url]
    if unknown:
        raise manifest_lacks(manifest.rank, unknown)
    return ids
