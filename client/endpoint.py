"""Where a client reaches ckptd: an explicit URL and token, else ``CKPTD_URL`` and
``CKPTD_TOKEN`` (as the CLI reads them); and the one check of such a URL
(``check_url``), whose lines the ``Checkpointer``, the Lightning plugin and the
CLI share."""

from __future__ import annotations

import os
import re

from ckptd.cluster import parse_url, parse_urls
from ckptd.errors import InvalidRequest

USE = "http://host:port, file:///path or s3://bucket/prefix"

# A server's host:port written without its scheme (localhost:8470, 10.0.0.5:8470,
# [::1]:8470, ckptd:8470).
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):[0-9]{1,5}")


def endpoint(url: str | None, token: str | None) -> tuple[str, str | None]:
    """``(url, token)``: each argument, or its ``CKPTD_*`` variable when None; the URL
    checked (``check_url``)."""
    given = "url"
    if url is None:
        url = os.environ.get("CKPTD_URL") or None
        given = "CKPTD_URL"
    if url is None:
        raise InvalidRequest(
            "no ckptd URL: pass url= (http://host:port, file:///path or s3://bucket/prefix) "
            "or set CKPTD_URL"
        )
    if not isinstance(url, str):  # Checkpointer(1234): a port, not a URL
        raise InvalidRequest("url must be a string (http://host:port, file:///path or "
                             f"s3://bucket/prefix), not {type(url).__name__} {url!r}")
    check_url(url, given)
    if token is None:
        token = os.environ.get("CKPTD_TOKEN") or None
    return url, token


def check_url(url: str, given: str = "url") -> str:
    """``url`` when a client opens it (a server's ``http(s)://host:port``, several
    comma-separated, ``file:///path``, ``s3://bucket/prefix``); ``InvalidRequest`` in
    a line otherwise, naming it as ``given`` (``url``, ``CKPTD_URL``, ``--url``): a
    path or query after a server's port (the API's paths are added to it: "no route
    for GET /v1/v1/..."), and a ``host:port`` without its scheme, naming the URL
    meant."""
    parsed = parse_url(url, USE)
    if parsed.scheme in ("http", "https"):
        parse_urls(url)  # (each replica's host and port)
        for part in url.split(","):
            each = parse_url(part.strip(), "http://host:port")
            if each.path.strip("/") or each.query or each.params or each.fragment:
                raise InvalidRequest(f"server URL {part.strip()!r} has a path or query: a "
                                     "server URL is http://host:port, nothing after the port "
                                     f"({_setting(given, f'{each.scheme}://{each.netloc}')})")
        return url
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise InvalidRequest(f"file URL {url!r} must name a local directory as "
                                 "file:///absolute/path (three slashes)")
        return url
    if parsed.scheme == "s3":
        return url
    # No scheme, or a host that urlparse took for one (localhost:8470).
    if is_host_port(url):
        raise InvalidRequest(f"{given} {url!r} has no scheme: did you mean http://{url}?")
    if not parsed.scheme and url.strip():
        raise InvalidRequest(f"{given} {url!r} is a path, not a URL: a directory store is "
                             f"file://{os.path.abspath(url)}, a server http://host:port")
    raise InvalidRequest(f"unsupported URL {url!r}: use {USE}")


def is_host_port(url: str) -> bool:
    """True for ``host:port`` (``10.0.0.5:8470``, ``ckptd:8470``, ``[::1]:8470``)."""
    if not _HOST_PORT.fullmatch(url):
        return False
    try:
        parse_urls(f"http://{url}")
        return parse_url(f"http://{url}").port is not None
    except (InvalidRequest, ValueError):
        return False


def _setting(given: str, value: str) -> str:
    """``url=VALUE``, ``CKPTD_URL=VALUE`` or ``--url VALUE``: as the user gives it."""
    return f"{given} {value}" if given.startswith("--") else f"{given}={value}"


def cache_root(value: str | os.PathLike[str], given: str = "cache_dir") -> str:
    """The directory a ``cache_dir`` (or ``CKPTD_CACHE_DIR``) names: a path, or
    ``file:///path`` as a store's URL is written (taken as a relative path, it named
    nothing, and the cache tier gave nothing, unsaid). ``InvalidRequest`` for
    another URL: the cache is a local directory (what ``ckptd restore --to DIR``
    fills)."""
    text = os.fspath(value)
    if "://" not in text:
        return text
    parsed = parse_url(text, "file:///path")
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or not parsed.path:
        raise InvalidRequest(f"{given} {text!r} is not a local directory: give its path (or "
                             "file:///path), the directory `ckptd restore --to DIR` filled")
    return parsed.path
