"""Chunks: content-addressed blobs, hashed on the way in, streamed as stored on the way out.

Each chunk is verified once per hop: the server hashes what it receives (it does not
trust the client), and the client hashes what it receives (it does not trust the
server), so the server does not hash again what it serves; ``ckptd verify`` (and
``Repository.verify``) checks the store at rest.

A chunk of a store on this host's filesystem is served from a read-only map of its
file (the socket copies straight from the page cache): reading it into memory
first cost a third of the server's CPU per byte served. Chunk files are written
once under a temporary name and renamed, never changed or truncated; garbage
collection unlinks them, which leaves a map valid. Every page of a map is read in
before it is served (``ckptd.pages``): a page the disk cannot give back is then an
error for that one chunk (it is read through the store instead, and fails there),
not a SIGBUS that kills the server."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from ckptd import knobs
from ckptd.api import ChunkStored, MissingRequest, MissingResponse
from ckptd.chunk_reads import (
    CHUNK_SIZES_HEADER,
    MISSING_SIZE,
    ChunkReadRequest,
    chunk_sizes_header,
)
from ckptd.errors import ChunkNotFound, CkptdError, LengthRequired, http_status
from ckptd.format import check_chunk_id, chunk_key
from ckptd.pages import map_readable
from ckptd.repository import Repository
from ckptd.server.auth import CHUNK_READ, CHUNK_WRITE, acting_job, authenticate, scope
from ckptd.server.bodies import (
    BUFFERS,
    ChunkBody,
    body_timeout,
    declared_chunk_bytes,
    ingest_budget,
    read_chunk,
)
from ckptd.server.deps import ChunkIdDep, MetricsDep, RepoDep, TenantsDep
from ckptd.server.egress import EgressHold, egress_budget
from ckptd.server.errors import as_told, error_response, log_answered
from ckptd.server.ingest import DIRECT, ChunkSink
from ckptd.server.metrics import Metrics
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute
from ckptd.server.tenancy import TenantChunks

log = logging.getLogger(__name__)



class ChunkSegment(Convertor[str]):
    """A path segment that may name a chunk: any but the names of the fixed routes
    beside ``/{id}``. So ``GET /v1/chunks/missing`` is answered by its POST route,
    405 with ``Allow: POST``, not read as a chunk id "missing" (400 invalid_name);
    any other segment still reaches the id check, which says what an id is."""

    FIXED = ("missing", "read")
    regex = f"(?!(?:{'|'.join(FIXED)})$)[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("chunk", ChunkSegment())  # (before the routes below compile it)

router = APIRouter(
    prefix="/v1/chunks",
    tags=["chunks"],
    route_class=ApiRoute,
    dependencies=scope(CHUNK_READ),
    responses=error_responses(400, 401, 500),
)

# What one multi-chunk answer holds in memory at most (a store whose chunks are not
# files here, such as S3), plus the chunk that crosses it: 64 chunks of 4 MiB would
# be 256 MiB held until a slow client has read them all.
READ_HOLD = 16 * knobs.MiB

_BINARY: dict[str, Any] = {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
}


class ChunkResponse(Response):
    """A chunk's bytes as one body message (uvloop writes a memoryview without a copy
    and keeps it until it is sent), counted in the metrics once it was handed over.

    Not a ``StreamingResponse``: its task group (a disconnect listener beside the
    sender) and a send per piece were most of the server's CPU per chunk read."""

    def __init__(self, data: bytes | memoryview, metrics: Metrics, started: float,
                 hold: EgressHold | None = None, send_timeout: float = 60.0) -> None:
        # (No media type on the class: the OpenAPI document would then give the
        # route's JSON error answers as octet-stream.)
        super().__init__(memoryview(data), media_type="application/octet-stream")
        self._metrics = metrics
        self._started = started
        self._hold = hold
        self._send_timeout = send_timeout
        if hold is not None:  # (an answer never sent releases when it goes)
            weakref.finalize(self, hold.release)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if self._hold is None:
            await send({"type": "http.response.body", "body": self.body})
        else:
            # Read into memory under the egress budget: sent in pieces, so that the
            # budget is given back only once the connection took (nearly) all of it
            # (each send waits for the one before to drain; one whole body would
            # return at once and sit in the transport's buffer, uncounted).
            try:
                if not await _send_held(send, [memoryview(self.body)], self._send_timeout):
                    return  # a reader that stopped reading: its connection is closed
            finally:
                self._hold.release()
        # Counted once the whole chunk was handed to the connection, as the last
        # piece of a streamed one was.
        self._metrics.chunk_read(len(self.body), time.perf_counter() - self._started)


class ChunksResponse(Response):
    """Several chunks' bytes back to back, a body message per chunk (each a view of
    its map), their sizes in the ``X-Ckptd-Chunk-Sizes`` header; each is counted in
    the metrics once it was handed over, as a GET's is."""

    def __init__(self, parts: list[memoryview | None], metrics: Metrics, started: float,
                 holds: dict[int, EgressHold] | None = None, send_timeout: float = 60.0
                 ) -> None:
        sizes = [None if p is None else len(p) for p in parts]
        super().__init__(
            media_type="application/octet-stream",
            headers={"Content-Length": str(sum(n or 0 for n in sizes)),
                     CHUNK_SIZES_HEADER: chunk_sizes_header(sizes)},
        )
        # Each part with its budget hold, if it was read into memory.
        self._parts = [p for p in parts if p is not None]
        self._holds = list((holds or {}).values())
        self._metrics = metrics
        self._started = started
        self._send_timeout = send_timeout
        for hold in self._holds:
            weakref.finalize(self, hold.release)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if not self._holds:
            for part in self._parts:
                # (uvicorn waits for the connection to drain before it writes the next)
                await send({"type": "http.response.body", "body": part, "more_body": True})
                self._metrics.chunk_read(len(part), time.perf_counter() - self._started)
            await send({"type": "http.response.body", "body": b""})
            return
        try:  # parts read into memory: as ChunkResponse sends one
            if not await _send_held(send, self._parts, self._send_timeout):
                return
        finally:
            for hold in self._holds:
                hold.release()
        for part in self._parts:
            self._metrics.chunk_read(len(part), time.perf_counter() - self._started)


# Pieces an answer read into memory is sent in (each send waits for the connection
# to drain the one before).
HELD_PIECE = knobs.MiB


async def _send_held(send: Send, parts: list[memoryview], timeout: float) -> bool:
    """Sends ``parts`` in pieces and ends the body; False when the reader took
    nothing for ``timeout`` seconds (the body is left unended: uvicorn closes the
    connection, and its budget is not held by a reader that stopped)."""
    try:
        for part in parts:
            for start in range(0, len(part), HELD_PIECE):
                piece = part[start:start + HELD_PIECE]
                await asyncio.wait_for(
                    send({"type": "http.response.body", "body": piece, "more_body": True}),
                    timeout)
        await asyncio.wait_for(send({"type": "http.response.body", "body": b""}), timeout)
    except TimeoutError:
        log.warning("a chunk reader took nothing for %.0f s; its connection is closed",
                    timeout)
        return False
    return True


@router.post(
    "/missing",
    response_model=MissingResponse,
    summary="Which of these chunks the store lacks (and lease them to a claimer)",
    responses=error_responses(413, 415),
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
    "/{id:chunk}",
    status_code=201,
    response_model=ChunkStored,
    summary="Store a chunk (its raw bytes); stored only if they hash to its id",
    responses={
        200: {"model": ChunkStored, "description": "The store already held this chunk"},
        **error_responses(411, 413, 422),
    },
    openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
    dependencies=scope(CHUNK_WRITE),
)
async def put_chunk(cid: ChunkIdDep, request: Request, response: Response) -> ChunkStored:
    # (Under ``ckptd serve`` an upload with a Content-Length is answered by
    # ``direct_chunk_app``; this route takes the others, and every upload of an app
    # served some other way.)
    if ("content-length" not in request.headers
            and "chunked" not in request.headers.get("transfer-encoding", "").lower()):
        # HTTP reads such a request as one with no body: its sender forgot the length
        # (a 422 for the empty body's hash would say its bytes were wrong).
        raise LengthRequired("a chunk upload needs a Content-Length (or Transfer-Encoding: "
                             "chunked); without either it has no body")
    job: str | None = request.state.acting_job
    stored = await store_upload(request, cid, job, lambda: read_chunk(request))
    if not stored.created:
        response.status_code = 200
    return stored


async def store_upload(request: Request, cid: str, job: str | None,
                       read: Callable[[], Awaitable[ChunkBody]]) -> ChunkStored:
    """Reads a chunk upload's body with ``read`` under the ingest budget, stores it
    once its bytes hash to ``cid``, and says whether ``job`` (the caller's) knew it."""
    started = time.perf_counter()
    repo: Repository = request.app.state.repository
    metrics: Metrics = request.app.state.metrics
    try:
        # Reserved before a byte is buffered; held until the store has the chunk.
        async with ingest_budget(request).hold(declared_chunk_bytes(request)):
            body = await read()
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
        tenants: TenantChunks = request.app.state.tenants
        created = not tenants.uploaded(job, cid)
    return ChunkStored(id=cid, size=body.size, created=created)


async def read_direct(request: Request, sink: ChunkSink) -> ChunkBody:
    """A chunk upload's body, which its connection reads straight into a buffer
    (``ckptd.server.ingest``). Not hashed here: the store's put hashes it in the
    thread that writes it, before it writes (one thread hand-off per chunk; two,
    a hash's and a write's, cost ~5% of ingest's CPU in context switches)."""
    buffer = BUFFERS.take(sink.size)
    sink.attach(buffer)
    await sink.wait(body_timeout(request))
    return ChunkBody(buffer, sink.size, None)


def direct_chunk_app(app: FastAPI) -> ASGIApp:
    """The ASGI app of ``PUT /v1/chunks/{id}`` uploads whose connection receives the
    body itself, and of ``GET /v1/chunks/{id}`` (``ckptd.server.ingest``): the routes
    here without the FastAPI and Starlette layers, which cost about a millisecond of
    CPU per request. The same checks in the same order (``ApiRoute``: the caller,
    its scope, the job it acts for), the same budget, verification and answers,
    errors included."""

    async def chunk(scope: Scope, receive: Receive, send: Send) -> None:
        sink: ChunkSink | None = scope["extensions"][DIRECT]
        needs = CHUNK_READ if sink is None else CHUNK_WRITE
        scope["app"] = app
        request = Request(scope, receive)
        state = app.state
        try:
            grant = authenticate(request)
            needs.check(grant, None)
            job = acting_job(request, grant, needs.role)
            request.state.caller = grant
            request.state.acting_job = job
            cid = check_chunk_id(scope["path"].rpartition("/")[2])
            if sink is None:
                answer: Response = await get_chunk(cid, request, state.repository,
                                                   state.metrics, state.tenants)
            else:
                stored = await store_upload(request, cid, job,
                                            lambda: read_direct(request, sink))
                answer = Response(stored.model_dump_json().encode(),
                                  status_code=201 if stored.created else 200,
                                  media_type="application/json")
        except ClientDisconnect:
            log.info("%s %s: client went away mid-request", scope["method"], scope["path"])
            return
        except CkptdError as exc:
            status = http_status(exc.code)
            log_answered(scope["method"], scope["path"], exc, status)
            # A body not read to its end would be read as the next request.
            answer = error_response(
                as_told(request, exc), status,
                None if sink is None or sink.complete else {"Connection": "close"})
        except Exception as exc:
            log.error("%s %s failed", scope["method"], scope["path"], exc_info=exc)
            answer = error_response(CkptdError("internal server error; see the server log"),
                                    500, {"Connection": "close"})
        await answer(scope, receive, send)

    return chunk


@router.head(
    "/{id:chunk}",
    summary="Whether the store holds a chunk",
    responses={200: {"description": "Stored"}, **error_responses(404)},
)
async def has_chunk(
    cid: ChunkIdDep, request: Request, repo: RepoDep, tenants: TenantsDep
) -> Response:
    # Whether the caller may see it first, as GET does: asked the other way round, the
    # store's look made another tenant's chunk a measurably slower 404 than an id
    # nobody stored (a probe timed it), telling that the store holds it.
    if not await _visible(request, tenants, cid) or not await repo.has_chunk(cid):
        raise ChunkNotFound(f"chunk {cid} is not in the store", id=cid)
    return Response(status_code=200)


@router.get(
    "/{id:chunk}",
    response_class=ChunkResponse,
    status_code=200,
    summary="A chunk's raw bytes, streamed",
    responses={200: {"content": _BINARY, "description": "The chunk"}, **error_responses(404, 422)},
)
async def get_chunk(
    cid: ChunkIdDep, request: Request, repo: RepoDep, metrics: MetricsDep, tenants: TenantsDep,
) -> ChunkResponse:
    # (Also called by ``direct_chunk_app``, which answers most GETs under ckptd serve.)
    started = time.perf_counter()
    if not await _visible(request, tenants, cid):
        raise ChunkNotFound(f"chunk {cid} is not in the store", id=cid)
    # Not re-hashed: every reader verifies a chunk against its id on arrival.
    path = repo.store.local_path(chunk_key(cid))
    # Opened, mapped and read in on the loop: microseconds for a chunk in the page
    # cache (a cold one's pages are read here, where the socket send that runs on the
    # loop would read them anyway), where a worker thread's round trip cost a tenth
    # of the server's CPU per request.
    data = map_readable(path) if path is not None else None
    if data is not None:
        return ChunkResponse(data, metrics, started)
    # Read whole into memory: under the budget of answers held at once, from before
    # the store is asked until the connection has it.
    hold = await egress_budget(request).reserve()
    try:
        data = await repo.get_chunk(cid, verify=False)
    except BaseException:
        hold.release()
        raise
    hold.resize(len(data))
    return ChunkResponse(data, metrics, started, hold, body_timeout(request))


@router.post(
    "/read",
    response_class=ChunksResponse,
    status_code=200,
    summary="Several chunks' raw bytes, back to back, in one answer",
    responses={
        200: {
            "content": _BINARY,
            "description": f"The chunks asked, in order; the {CHUNK_SIZES_HEADER} header "
            f"gives each one's size, '{MISSING_SIZE}' for one not sent (not stored, or not "
            "the caller's job's).",
            "headers": {CHUNK_SIZES_HEADER: {"schema": {"type": "string"}}},
        },
        **error_responses(413, 415),
    },
)
async def read_chunks(
    body: ChunkReadRequest, request: Request, repo: RepoDep, metrics: MetricsDep,
    tenants: TenantsDep,
) -> ChunksResponse:
    started = time.perf_counter()
    ids = [check_chunk_id(cid) for cid in body.ids]
    job: str | None = request.state.acting_job
    # One visibility question for them all; a chunk the caller may not see is answered
    # as one that is not stored, as GET answers 404 for it.
    seen = set(ids) if job is None else await tenants.known(job, ids)
    parts: list[memoryview | None] = []
    holds: dict[int, EgressHold] = {}  # parts read into memory, under the egress budget
    held = 0  # bytes read into memory (a store whose chunks are not files here)
    budget = egress_budget(request)
    try:
        for i, cid in enumerate(ids):
            data: bytes | memoryview | None = None
            if cid in seen:
                path = repo.store.local_path(chunk_key(cid))
                data = map_readable(path) if path is not None else None
                if data is None and held < READ_HOLD and (hold := budget.try_reserve()):
                    try:
                        data = await repo.get_chunk(cid, verify=False)
                    except ChunkNotFound:
                        hold.release()
                    except BaseException:  # (a store error, a client gone: not leaked)
                        hold.release()
                        raise
                    else:
                        hold.resize(len(data))
                        holds[i] = hold
                        held += len(data)
                # Past READ_HOLD or the budget, the rest are not sent ("-"): the reader
                # asks for them again, one by one (a GET holds one chunk at a time).
            parts.append(None if data is None else memoryview(data))
    except BaseException:
        for hold in holds.values():
            hold.release()
        raise
    return ChunksResponse(parts, metrics, started, holds, body_timeout(request))


async def _visible(request: Request, tenants: TenantChunks, cid: str) -> bool:
    """Whether the caller may see chunk ``cid`` (a scoped caller: its job knows it)."""
    job: str | None = request.state.acting_job
    return job is None or cid in await tenants.known(job, [cid])
