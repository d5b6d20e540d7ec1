"""``GET /healthz``: is the server up, and over which store. Needs no token."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ckptd import __version__
from ckptd.server.deps import RepoDep
from ckptd.server.models import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness, version and store")
async def healthz(repo: RepoDep, request: Request) -> Health:
    return Health(
        version=__version__,
        store=repo.store.describe(),
        http_parser=getattr(request.app.state, "http_parser", None),
        event_loop=event_loop_name(),
    )


def event_loop_name() -> str:
    """The running event loop's kind: ``uvloop`` or ``asyncio``."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
