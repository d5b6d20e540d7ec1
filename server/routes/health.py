"""``GET /healthz``: is the server up, and over which store. Needs no token."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

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


API_DOCS = (
    "The ckptd HTTP API is described in docs/API.md (in the ckptd sources and on its\n"
    "project page); its OpenAPI document is at /openapi.json. There is no Swagger UI\n"
    "here: it would load its assets from a CDN, which a server off the internet cannot.\n"
)


@router.get("/docs", include_in_schema=False, response_class=PlainTextResponse)
async def docs() -> str:
    return API_DOCS
