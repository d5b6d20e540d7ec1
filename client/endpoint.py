"""Where a client reaches ckptd: an explicit URL and token, else ``CKPTD_URL`` and
``CKPTD_TOKEN`` (as the CLI reads them)."""

from __future__ import annotations

import os

from ckptd.errors import InvalidRequest


def endpoint(url: str | None, token: str | None) -> tuple[str, str | None]:
    """``(url, token)``: each argument, or its ``CKPTD_*`` variable when None."""
    if url is None:
        url = os.environ.get("CKPTD_URL") or None
    if url is None:
        raise InvalidRequest(
            "no ckptd URL: pass url= (http://host:port, file:///path or s3://bucket/prefix) "
            "or set CKPTD_URL"
        )
    if not isinstance(url, str):  # Checkpointer(1234): a port, not a URL
        raise InvalidRequest("url must be a string (http://host:port, file:///path or "
                             f"s3://bucket/prefix), not {type(url).__name__} {url!r}")
    if token is None:
        token = os.environ.get("CKPTD_TOKEN") or None
    return url, token
