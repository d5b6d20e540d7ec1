"""``GET /healthz``: is the server up and its store readable, and which version.
Needs no token; the details (which store) need one that sees every job."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ckptd import __version__
from ckptd.errors import CkptdError
from ckptd.server.auth import identify
from ckptd.server.deps import RepoDep
from ckptd.server.models import Health

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
    "/healthz",
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
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)
