"""``GET /healthz``: is the server up, and over which store. Needs no token."""

from __future__ import annotations

from fastapi import APIRouter

from ckptd import __version__
from ckptd.server.deps import RepoDep
from ckptd.server.models import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness, version and store")
async def healthz(repo: RepoDep) -> Health:
    return Health(version=__version__, store=repo.store.describe())
