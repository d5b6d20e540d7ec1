"""Stores: where chunks, manifests, commit records and refs live."""

from __future__ import annotations

from urllib.parse import urlparse

from ckptd.errors import InvalidRequest
from ckptd.store.base import Store, check_key
from ckptd.store.local import LocalStore
from ckptd.store.memory import MemoryStore

__all__ = ["LocalStore", "MemoryStore", "Store", "check_key", "open_store"]


def open_store(url: str) -> Store:
    """A store from a URL: a path or ``file:///path``, or ``memory://``."""
    if url.startswith("memory://"):
        return MemoryStore()
    if url.startswith("file://"):
        return LocalStore(urlparse(url).path)
    if "://" in url:
        raise InvalidRequest(f"unsupported store URL {url!r} (use a path or file:///path)")
    return LocalStore(url)
