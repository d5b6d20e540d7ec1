"""Stores: where chunks, manifests, commit records and refs live."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from ckptd.errors import InvalidRequest
from ckptd.store.base import Store, check_key
from ckptd.store.local import LocalStore
from ckptd.store.memory import MemoryStore

if TYPE_CHECKING:
    from ckptd.store.s3 import S3Store

__all__ = ["LocalStore", "MemoryStore", "S3Store", "Store", "check_key", "open_store"]


def __getattr__(name: str) -> Any:
    # S3Store needs the optional aiobotocore (the "s3" extra): import it on first use.
    if name == "S3Store":
        from ckptd.store.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(url: str, *, direct: bool = False, create: bool = True) -> Store:
    """A store from a URL: a path or ``file:///path``, ``memory://``, or
    ``s3://bucket/prefix`` (optionally ``?endpoint=http://host:port&region=r``).
    ``direct``: its writers use it with no ``ckptd serve`` in front (ranks, the CLI),
    so no server's start checked that it writes conditionally: an S3 store checks
    before its first conditional write (``S3Store.check_conditions``).
    ``create=False`` (who reads or tends an existing store): ``NotFound`` naming the
    URL where there is none, a directory at once, an S3 prefix at its first call."""
    if url.startswith("memory://"):
        return MemoryStore()
    if url.startswith("file://"):
        if urlparse(url).netloc not in ("", "localhost"):  # file://x/y: host x, path /y
            raise InvalidRequest(f"file URL {url!r} names a host; a store directory is "
                                 "file:///absolute/path (three slashes), or the path itself")
        return LocalStore(urlparse(url).path, create=create)
    if url.startswith("s3://"):
        parsed = urlparse(url)
        _refuse_credentials(parsed.netloc, parse_qs(parsed.query).get("endpoint", []))
        if not parsed.netloc:
            raise InvalidRequest(f"store URL {url!r} names no bucket (s3://bucket/prefix)")
        query = parse_qs(parsed.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"endpoint", "region"})
        if unknown:
            raise InvalidRequest(
                f"store URL {url!r}: unknown parameters {unknown} (known: endpoint, region)"
            )
        try:
            from ckptd.store.s3 import S3Store
        except ImportError as exc:
            raise InvalidRequest(
                f"s3:// stores need aiobotocore (pip install 'ckptd[s3]'): {exc}"
            ) from exc
        store = S3Store(
            parsed.netloc,
            parsed.path.strip("/"),
            endpoint_url=(query.get("endpoint") or [""])[-1] or None,
            region=(query.get("region") or [""])[-1] or None,
        )
        store.check_conditions = direct
        store.must_exist = not create
        return store
    if "://" in url:
        raise InvalidRequest(
            f"unsupported store URL {url!r} (use a path, file:///path or s3://bucket/prefix)"
        )
    return LocalStore(url, create=create)


def _refuse_credentials(bucket: str, endpoints: list[str]) -> None:
    """``InvalidRequest`` for an s3:// URL that holds credentials (``s3://key:secret@
    bucket``, ``?endpoint=http://user:pass@host``), in a line that never repeats them:
    the URL is printed in errors, logs and ``/healthz``."""
    if "@" in bucket or any("@" in urlparse(e).netloc for e in endpoints):
        where = "?endpoint=" if "@" not in bucket else "the bucket"
        raise InvalidRequest(f"the store URL holds credentials (user:password@ in {where}), "
                             "which ckptd would print and log: credentials go in "
                             "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
