"""Bearer-token authentication: with ``settings.token`` set, every route but
``GET /healthz`` needs ``Authorization: Bearer <token>``."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ckptd.errors import Unauthorized
from ckptd.server.settings import Settings

# auto_error=False: a missing or malformed header is ours to answer (401 with a
# code), not FastAPI's (403 with its own body). The scheme also documents the
# token in the OpenAPI document.
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="The server's token (ckptd serve --token, or CKPTD_TOKEN).",
)


def check_token(settings: Settings, authorization: str | None) -> None:
    """Raises ``Unauthorized`` unless ``authorization`` carries the server's token."""
    if settings.token is None:
        return
    scheme, _, credentials = (authorization or "").partition(" ")
    # compare_digest on bytes: constant time, and no TypeError on non-ASCII input.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        credentials.strip().encode("utf-8"), settings.token.encode("utf-8")
    ):
        raise Unauthorized("missing or wrong bearer token")


async def require_token(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> None:
    check_token(request.app.state.settings, request.headers.get("authorization"))
