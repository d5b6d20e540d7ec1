"""The route class of every ``/v1`` route."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ckptd.errors import InvalidRequest
from ckptd.format import MAX_JSON_DEPTH, json_too_deep
from ckptd.server.auth import check_token
from ckptd.server.bodies import bounded, json_body_limit


class ApiRoute(APIRoute):
    """Checks the token, then bounds a JSON body, before FastAPI reads the body.

    FastAPI parses a JSON body before it runs any dependency, so without this an
    unauthenticated caller with bad JSON would get 400 instead of 401, and a JSON
    body would have no size limit. Routes that read their body themselves (chunks,
    manifests) declare no body parameter and bound it as they read."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        parses_body = self.body_field is not None

        async def handle(request: Request) -> Response:
            check_token(request.app.state.settings, request.headers.get("authorization"))
            if parses_body:
                request = bounded(request, json_body_limit(), "JSON body")
                body = await request.body()  # read here, so TooLarge is ours and not a 400
                if json_too_deep(body):  # before FastAPI's parser recurses into it
                    raise InvalidRequest(f"JSON body nests deeper than {MAX_JSON_DEPTH} levels")
            return await handler(request)

        return handle
