"""The one place that turns errors into HTTP answers.

Every error answer is ``{"code", "message", "detail"}`` with the status that
``ckptd.errors.http_status`` gives its code."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ckptd.errors import (
    CkptdError,
    Forbidden,
    InvalidName,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    StoreError,
    TooLarge,
    Unauthorized,
    http_status,
)
from ckptd.server.auth import identify

log = logging.getLogger(__name__)

# Starlette's own refusals (no route, wrong method, ...) by status; others are
# answered as invalid_request (4xx) or internal (5xx), keeping their status.
_STARLETTE_CODES: dict[int, type[CkptdError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    413: TooLarge,
}

# Refusals after which the rest of the request body is not worth reading.
_CLOSE_AFTER = {401, 403, 408, 413, 503, 507}

# Validation errors located here are about a name in the URL: anything in the path,
# and the query's names (a budget or a grace period out of range is not a name).
_NAME_LOCATIONS = {"path"}
_QUERY_NAMES = {"job", "step", "rank"}


def error_response(
    err: CkptdError, status: int | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    status = status if status is not None else http_status(err.code)
    answer_headers = dict(headers or {})
    if status == 401:
        answer_headers["WWW-Authenticate"] = "Bearer"
    if status in _CLOSE_AFTER:
        # The body of a refused request may still be arriving (2 GiB with no token):
        # closing the connection stops it, where keep-alive would read it all.
        answer_headers["Connection"] = "close"
    if status == 503:
        answer_headers.setdefault("Retry-After", "1")
    return JSONResponse(err.to_json(), status_code=status, headers=answer_headers)


def log_answered(method: str, path: str, exc: CkptdError, status: int) -> None:
    """Logs an error answered with ``status``: a typed 5xx (gc_in_progress,
    store_corrupt, store_full, ...) says what happened, in one WARNING line; only
    ``internal`` (not one ckptd expects) gets its traceback at ERROR."""
    if status >= 500 and exc.code == CkptdError.code:
        log.error("%s %s: %s", method, path, exc.code, exc_info=exc)
    elif status >= 500:
        # The code is in the message: the repeat filter (connections.REPEATS, keyed
        # by message) then drops a flood of one code, never the first of another.
        log.warning(f"%s %s: {status} {exc.code}: %s", method, path, exc.message)
        log.debug("%s %s: %s", method, path, exc.code, exc_info=exc)
    else:
        log.debug("%s %s: %s: %s", method, path, exc.code, exc.message)


async def _ckptd_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CkptdError)
    status = http_status(exc.code)
    log_answered(request.method, request.url.path, exc, status)
    return error_response(as_told(request, exc), status)


def as_told(request: Request, exc: CkptdError) -> CkptdError:
    """``exc`` as the caller may read it. A store backend's own failure names where
    the store is (an S3 URL, its endpoint; in an AccessDenied, the server's cloud
    identity): the operator's, like ``/healthz``'s details (docs/SECURITY.md), so a
    caller without a token on every job gets the key only; the log has the rest.
    (Subclasses, such as ``store_full`` or ``store_corrupt``, say what ckptd found.)
    Every answer of an error goes through here, the lean chunk route's too."""
    if exc.code != StoreError.code:
        return exc
    grant = identify(request)
    if grant is not None and grant.every_job and grant.may("read", None):
        return exc
    key = exc.detail.get("key")
    where = f" on {key}" if isinstance(key, str) else ""
    return StoreError(f"the store failed{where}; the server's log says why",
                      **({"key": key} if isinstance(key, str) else {}))


def _describe(error: dict[str, Any]) -> dict[str, Any]:
    # Only where and what: the input can be a whole (large) body and ctx can hold
    # exception objects that do not encode as JSON.
    return {
        "loc": [str(part) for part in error.get("loc", ())],
        "msg": str(error.get("msg", "")),
        "type": str(error.get("type", "")),
    }


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [_describe(e) for e in exc.errors()]
    # A bad name in the URL is the answer even when the body is bad too: the
    # patterns are checked with the body, not before it as the old checks were.
    in_url = [e for e in errors if e["loc"] and (
        e["loc"][0] in _NAME_LOCATIONS
        or (e["loc"][0] == "query" and e["loc"][1:2] and e["loc"][1] in _QUERY_NAMES))]
    errors = in_url + [e for e in errors if e not in in_url]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(first["loc"])
    if first.get("type") == "json_invalid":
        message = "the request body is not valid JSON"
    else:
        message = f"{where}: {first['msg']}" if where else str(first["msg"])
    cls = InvalidName if in_url else InvalidRequest
    return error_response(cls(message, errors=errors[:20]))


async def _starlette_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    cls = _STARLETTE_CODES.get(exc.status_code)
    if cls is None:
        cls = InvalidRequest if exc.status_code < 500 else CkptdError
    message = exc.detail if isinstance(exc.detail, str) else f"HTTP {exc.status_code}"
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path[:200]}"
    allowed = (exc.headers or {}).get("Allow")
    if exc.status_code == 405 and allowed:
        message = (f"{request.method} is not a method of {request.url.path[:200]}; "
                   f"it takes {allowed}")
    return error_response(cls(message), exc.status_code, exc.headers)


async def _client_disconnect(request: Request, exc: Exception) -> JSONResponse:
    # Nobody reads this answer; the upload it cut off stored nothing.
    log.info("%s %s: client went away mid-request", request.method, request.url.path)
    return error_response(InvalidRequest("client disconnected"))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(CkptdError("internal server error; see the server log"), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(CkptdError, _ckptd_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _starlette_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_exception_handler(Exception, _unexpected)
