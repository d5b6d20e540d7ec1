"""``GET /healthz``: is the server up and its store readable, and which version.
Needs no token; the details (which store) need one that sees every job."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ckptd import __version__
from ckptd.api import HEALTHZ, Health
from ckptd.errors import CkptdError
from ckptd.server.auth import identify
from ckptd.server.deps import RepoDep

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

# A store probe at most this often (health checks and floods of them must not
# become store traffic), and no longer than this.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0
_probe: dict[int, tuple[float, bool]] = {}


async def _store_ok(repo: RepoDep) -> bool:
    now = time.monotonic()
    held = _probe.get(id(repo))
    if held is not None and now - held[0] < PROBE_EVERY_S:
        return held[1]
    try:
        await asyncio.wait_for(repo.store.exists("jobs/.healthz"), PROBE_TIMEOUT_S)
        ok = True
    except (CkptdError, OSError, TimeoutError) as exc:
        log.warning("health: the store does not answer: %s", exc)
        ok = False
    _probe[id(repo)] = (now, ok)
    return ok


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
