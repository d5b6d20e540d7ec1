"""``GET /healthz``: is the server up and its store readable, and which version.
Needs no token; the details (which store) need one that sees every job.
``GET /livez``: the process answers, the store not asked (a liveness probe's)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ckptd import __version__
from ckptd.api import HEALTHZ, LIVEZ, Health
from ckptd.server.auth import identify
from ckptd.server.deps import RepoDep

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

# A store probe at most this often (health checks and floods of them must not
# become store traffic), and no longer than this.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0


class _StoreProbe:
    """The store's last answer to the health probe, and the probe under way."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.at: float | None = None  # monotonic: when the last probe ended
        self.ok = False
        self.task: asyncio.Task[None] | None = None

    async def run(self, repo: RepoDep) -> None:
        try:
            await asyncio.wait_for(repo.store.exists("jobs/.healthz"), PROBE_TIMEOUT_S)
            ok = True
        except Exception as exc:  # (any failure of the store is a "not ok", logged)
            log.warning("health: the store does not answer: %s",
                        exc if str(exc) else f"no answer in {PROBE_TIMEOUT_S:g} s"
                        if isinstance(exc, TimeoutError) else type(exc).__name__)
            ok = False
        self.ok, self.at = ok, time.monotonic()


_probes: dict[int, _StoreProbe] = {}


async def _store_ok(repo: RepoDep) -> bool:
    """Whether the store answers, from a probe at most every PROBE_EVERY_S that runs
    beside the requests: an answer does not wait for it, so it never waits behind
    the data plane's store calls (a local store's share the default thread pool
    with 16 manifests' writes and fsyncs, which added 50 - 150 ms to /healthz). It
    waits only when no probe has ended for PROBE_EVERY_S + PROBE_TIMEOUT_S (the
    first one, or a store that hangs), for the one under way (PROBE_TIMEOUT_S at
    most)."""
    probe = _probes.get(id(repo))
    loop = asyncio.get_running_loop()
    if probe is None or probe.loop is not loop:  # (a new app, or a new loop in tests)
        probe = _probes[id(repo)] = _StoreProbe(loop)
    now = time.monotonic()
    if probe.task is None and (probe.at is None or now - probe.at >= PROBE_EVERY_S):
        task = probe.task = asyncio.create_task(probe.run(repo))

        def done(_: asyncio.Task[None]) -> None:
            probe.task = None

        task.add_done_callback(done)
    if probe.at is not None and now - probe.at < PROBE_EVERY_S + PROBE_TIMEOUT_S:
        return probe.ok
    if probe.task is not None:
        await asyncio.shield(probe.task)
    return probe.ok


@router.get(
    HEALTHZ,
    response_model=Health,
    response_model_exclude_none=True,
    summary="Liveness and version; the store's details with a token",
    responses={503: {"model": Health, "description": "The store does not answer"}},
)
async def healthz(request: Request, repo: RepoDep) -> JSONResponse:
    ok = await _store_ok(repo)
    grant = identify(request)
    details = grant is not None and grant.every_job
    body = Health(
        status="ok" if ok else "not ok",
        version=__version__,
        store=repo.store.describe() if details else None,
        http_parser=getattr(request.app.state, "http_parser", None) if details else None,
        event_loop=event_loop_name() if details else None,
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)


@router.get(
    LIVEZ,
    response_model=Health,
    response_model_exclude_none=True,
    summary="The process answers (the store is not asked): for liveness probes",
)
async def livez() -> Health:
    # A store that is down is /healthz's 503 (readiness: send nothing here), not a
    # reason to restart the server: a restarted one cannot open the store either,
    # and an orchestrator's growing back-off keeps it down after the store is back.
    return Health(status="ok", version=__version__)


def event_loop_name() -> str:
    """The running event loop's kind: ``uvloop`` or ``asyncio``."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


API_DOCS = (
    "The ckptd HTTP API is described in docs/API.md (in the ckptd sources and on its\n"
    "project page); its OpenAPI document is at /openapi.json. There is no Swagger UI\n"
    "here: it would load its assets from a CDN, which a server off the internet cannot.\n"
)


@router.get("/docs", include_in_schema=False, response_class=PlainTextResponse)
async def docs() -> str:
    return API_DOCS
