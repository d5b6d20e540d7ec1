"""Chunks: content-addressed blobs, hashed on the way in, streamed as stored on the way out.

Each chunk is verified once per hop: the server hashes what it receives (it does not
trust the client), and the client hashes what it receives (it does not trust the
server), so the server does not hash again what it serves; ``ckptd verify`` (and
``Repository.verify``) checks the store at rest.

A chunk of a store on this host's filesystem is served from a read-only map of its
file (the socket copies straight from the page cache): reading it into memory
first cost a third of the server's CPU per byte served. Chunk files are written
once under a temporary name and renamed, never changed or truncated; garbage
collection unlinks them, which leaves a map valid."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from ckptd import knobs
from ckptd.api import ChunkStored, MissingRequest, MissingResponse
from ckptd.errors import ChunkNotFound, CkptdError
from ckptd.format import chunk_key
from ckptd.server.auth import CHUNK_READ, CHUNK_WRITE, scope
from ckptd.server.bodies import BUFFERS, declared_chunk_bytes, ingest_budget, read_chunk
from ckptd.server.deps import ChunkIdDep, MetricsDep, RepoDep, TenantsDep
from ckptd.server.metrics import Metrics
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute
from ckptd.server.tenancy import TenantChunks

router = APIRouter(
    prefix="/v1/chunks",
    tags=["chunks"],
    route_class=ApiRoute,
    dependencies=scope(CHUNK_READ),
    responses=error_responses(400, 401, 500),
)

# Large reads: one chunk is in memory anyway, and each piece costs a send.
READ_PIECE = knobs.MiB

_BINARY: dict[str, Any] = {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
}


@router.post(
    "/missing",
    response_model=MissingResponse,
    summary="Which of these chunks the store lacks (and lease them to a claimer)",
    responses=error_responses(413),
    dependencies=scope(CHUNK_WRITE),
)
async def missing_chunks(
    body: MissingRequest, request: Request, repo: RepoDep, metrics: MetricsDep,
    tenants: TenantsDep,
) -> MissingResponse:
    job: str | None = request.state.acting_job
    result = await repo.missing_chunks(
        body.ids, claimer=body.claimer, tenant=job,
        known=None if job is None else (lambda ids: tenants.known(job, ids)),
    )
    metrics.missing_asked(len(body.ids), len(result.missing))
    return MissingResponse(missing=result.missing, in_flight=result.in_flight)


@router.put(
    "/{id}",
    status_code=201,
    response_model=ChunkStored,
    summary="Store a chunk (its raw bytes); hashed while it streams in",
    responses={
        200: {"model": ChunkStored, "description": "The store already held this chunk"},
        **error_responses(413, 422),
    },
    openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
    dependencies=scope(CHUNK_WRITE),
)
async def put_chunk(
    cid: ChunkIdDep, request: Request, response: Response, repo: RepoDep, metrics: MetricsDep,
    tenants: TenantsDep,
) -> ChunkStored:
    started = time.perf_counter()
    job: str | None = request.state.acting_job
    try:
        # Reserved before a byte is buffered; held until the store has the chunk.
        async with ingest_budget(request).hold(declared_chunk_bytes(request)):
            body = await read_chunk(request)
            with memoryview(body.buffer) as whole, whole[: body.size] as view:
                created = await repo.put_chunk(cid, view, digest=body.digest, tenant=job)
    except CkptdError as exc:
        metrics.upload_rejected(exc.code)
        raise
    # Only here, where put_chunk returned: a failed or cancelled one may have left a
    # store thread still writing from the buffer.
    BUFFERS.give(body.buffer)
    metrics.chunk_uploaded(body.size, time.perf_counter() - started, created)
    if job is not None:
        # A scoped caller learns only whether its own job knew the chunk: whether
        # another tenant had stored it stays unsaid.
        created = not tenants.uploaded(job, cid)
    if not created:
        response.status_code = 200
    return ChunkStored(id=cid, size=body.size, created=created)


@router.head(
    "/{id}",
    summary="Whether the store holds a chunk",
    responses={200: {"description": "Stored"}, **error_responses(404)},
)
async def has_chunk(
    cid: ChunkIdDep, request: Request, repo: RepoDep, tenants: TenantsDep
) -> Response:
    if not await repo.has_chunk(cid) or not await _visible(request, tenants, cid):
        raise ChunkNotFound(f"chunk {cid} is not in the store", id=cid)
    return Response(status_code=200)


@router.get(
    "/{id}",
    response_class=StreamingResponse,
    summary="A chunk's raw bytes, streamed",
    responses={200: {"content": _BINARY, "description": "The chunk"}, **error_responses(404, 422)},
)
async def get_chunk(
    cid: ChunkIdDep, request: Request, repo: RepoDep, metrics: MetricsDep, tenants: TenantsDep,
) -> StreamingResponse:
    started = time.perf_counter()
    if not await _visible(request, tenants, cid):
        raise ChunkNotFound(f"chunk {cid} is not in the store", id=cid)
    # Not re-hashed: every reader verifies a chunk against its id on arrival.
    path = repo.store.local_path(chunk_key(cid))
    data = await asyncio.to_thread(_mapped, path) if path is not None else None
    if data is None:
        data = await repo.get_chunk(cid, verify=False)
    return StreamingResponse(
        _pieces(data, metrics, started),
        media_type="application/octet-stream",
        headers={"Content-Length": str(len(data))},
    )


async def _visible(request: Request, tenants: TenantChunks, cid: str) -> bool:
    """Whether the caller may see chunk ``cid`` (a scoped caller: its job knows it)."""
    job: str | None = request.state.acting_job
    return job is None or cid in await tenants.known(job, [cid])


def _mapped(path: Path) -> memoryview | None:
    """A read-only map of a chunk file (None when it is not there: the store then
    says so). The map closes when the last piece sent from it is released."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        with contextlib.suppress(ValueError):  # an empty file cannot be mapped
            return memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
        return memoryview(b"")
    finally:
        os.close(fd)


async def _pieces(
    data: bytes | memoryview, metrics: Metrics, started: float
) -> AsyncIterator[memoryview]:
    view = memoryview(data)  # slices of immutable bytes or a read-only map: no copy
    for start in range(0, len(view), READ_PIECE):
        yield view[start : start + READ_PIECE]
    # Counted once the last piece went out: a reader that went away mid-chunk is not.
    metrics.chunk_read(len(data), time.perf_counter() - started)
