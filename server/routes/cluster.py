"""``GET /v1/cluster``: the live replicas over this store, for clients to route by."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ckptd.api import ClusterView
from ckptd.server.auth import require_token
from ckptd.server.cluster import Membership
from ckptd.server.routes import error_responses
from ckptd.server.routing import ApiRoute

router = APIRouter(
    prefix="/v1/cluster",
    tags=["cluster"],
    route_class=ApiRoute,
    dependencies=[Depends(require_token)],
    responses=error_responses(401, 500),
)


@router.get("", response_model=ClusterView, summary="The live replicas and how they are known")
async def cluster(request: Request) -> ClusterView:
    membership: Membership = request.app.state.membership
    view: ClusterView = await membership.view()
    return view
