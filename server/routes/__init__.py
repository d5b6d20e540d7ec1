"""One APIRouter per resource: health, chunks, manifests, jobs."""

from __future__ import annotations

from typing import Any

from ckptd.api import ErrorBody

_MEANING = {
    400: "Bad input: a name, body or parameter that does not parse or match its rules",
    401: "No token, or the wrong one",
    404: "Not found",
    409: "The request conflicts with what the store holds, or the ranks disagree",
    411: "An upload with neither a Content-Length nor chunked transfer encoding",
    413: "Body over the limit",
    415: "A body sent as another media type than application/json",
    422: "Bytes that do not hash to their name",
    500: "Server or store failure",
    503: "Busy for now (a garbage collection sweep); retry",
    507: "The store is nearly full: new snapshots are refused",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives (all are ErrorBody)."""
    return {s: {"model": ErrorBody, "description": _MEANING[s]} for s in statuses}
