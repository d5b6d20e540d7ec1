"""``GET /v1/cluster``: the live replicas over this store, for clients to route by."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ckptd.api import ClusterView
from ckptd.server.auth import READ_ANY, scope
from ckptd.server.cluster import Membership
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute

router = APIRouter(
    prefix="/v1/cluster",
    tags=["cluster"],
    route_class=ApiRoute,
    # Every client routes by it: a read token on any job may see the replicas.
    dependencies=scope(READ_ANY),
    responses=error_responses(401, 500),
)


@router.get("", response_model=ClusterView, summary="The live replicas and how they are known")
async def cluster(request: Request) -> ClusterView:
    membership: Membership = request.app.state.membership
    view: ClusterView = await membership.view()
    return view
