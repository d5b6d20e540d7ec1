"""The route class of every ``/v1`` route."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ckptd.errors import InvalidRequest
from ckptd.format import MAX_JSON_DEPTH, json_too_deep
from ckptd.server.auth import UNDECLARED, acting_job, authenticate, route_scope
from ckptd.server.bodies import (
    bounded,
    check_json_type,
    json_body_limit,
    refuse_non_finite,
)


class ApiRoute(APIRoute):
    """Checks the caller's scope, then bounds a JSON body, before FastAPI reads the body.

    FastAPI parses a JSON body before it runs any dependency, so without this an
    unauthenticated caller with bad JSON would get 400 instead of 401, and a JSON
    body would have no size limit. Routes that read their body themselves (chunks,
    manifests) declare no body parameter and bound it as they read.

    The scope is the route's ``Needs`` dependency (ckptd.server.auth); a route
    without one needs the server's own token (``UNDECLARED``)."""

    @property
    def scope(self) -> Any:
        """The ``Needs`` this route declared, or None."""
        return route_scope(self.dependencies)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        parses_body = self.body_field is not None
        needs = self.scope or UNDECLARED

        async def handle(request: Request) -> Response:
            grant = authenticate(request)
            job = request.path_params.get("job")
            needs.check(grant, job if isinstance(job, str) else None)
            request.state.caller = grant
            if needs.acts_for_job:
                request.state.acting_job = acting_job(request, grant, needs.role)
            if parses_body:
                request = bounded(request, json_body_limit(), "JSON body")
                body = await request.body()  # read here, so TooLarge is ours and not a 400
                if body:  # (a route whose body is optional may be sent none)
                    check_json_type(request)
                if json_too_deep(body):  # before any parser recurses into it
                    raise InvalidRequest(f"JSON body nests deeper than {MAX_JSON_DEPTH} levels")
                refuse_non_finite(body)
            return await handler(request)

        return handle
