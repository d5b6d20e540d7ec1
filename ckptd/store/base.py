"""The one storage interface every backend implements."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptd.errors import InvalidName, StoreError


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, with no empty, '.' or '..' component."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidName(f"bad store key {key[:200]!r}")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidName(f"bad store key {key[:200]!r}")
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key's directory part plus the start of a name
    (``"chunks/"``, ``"chunks/ab"``); its directory part follows the key rules."""
    if prefix:
        directory, _, name = prefix.rpartition("/")
        if directory:
            check_key(directory)
        if name in (".", "..") or name.startswith("/") or "\\" in name or "\x00" in name:
            raise InvalidName(f"bad store prefix {prefix[:200]!r}")
    return prefix


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A listed object: its key, its size, and when it was written (None: unknown)."""

    key: str
    size: int
    modified: float | None


class Store(ABC):
    """A flat, async key-value store of immutable objects plus CAS'd refs.

    Objects are written once with ``put_if_absent``; only refs change, and only
    through ``compare_and_swap``."""

    #: the backend keeps data after the process ends
    durable: bool = True
    #: ``compare_and_swap`` is atomic across processes (not only within one)
    cross_process_cas: bool = True

    @abstractmethod
    async def get(self, key: str) -> bytes:
        """The object's bytes; ``NotFound`` when absent."""

    @abstractmethod
    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Writes the object unless the key exists. True when this call wrote it."""

    async def put_content(self, key: str, data: bytes | memoryview,
                          verify: Callable[[], None] | None = None) -> bool:
        """``put_if_absent`` of a content-addressed object (a chunk: its key names its
        bytes, so any writer writes the same). True only when this call surely wrote
        it: where a store cannot tell (a retried write finding those bytes, which
        another writer may have put), False; the object is there either way.

        ``verify``: a blocking check of the bytes (their hash), run first, whether
        or not the object exists, where the store's own blocking work runs (a
        local store's thread: one hand-off per chunk, not two); what it raises ends
        the put with nothing written."""
        if verify is not None:
            await asyncio.to_thread(verify)
        return await self.put_if_absent(key, data)

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Removes the object; absent keys are not an error."""

    @abstractmethod
    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key that starts with ``prefix``, in no set order."""

    @abstractmethod
    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        """Sets ``key`` to ``new`` if it now holds ``expected`` (None: absent).

        True when this call changed it; False when the current value differs."""

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        """Removes ``key`` if it now holds ``expected``; True when this call removed it.

        A backend without an atomic form refuses (``StoreError``) rather than
        deleting what a concurrent writer just put there."""
        raise StoreError(f"{self.describe()} cannot delete {key} conditionally", key=key)

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return list(await asyncio.gather(*(self.exists(k) for k in keys)))

    async def list_dir(self, prefix: str) -> list[str]:
        """The distinct names one level below ``prefix`` (which ends with '/')."""
        check_prefix(prefix)
        names: set[str] = set()
        async for key in self.list_prefix(prefix):
            names.add(key[len(prefix) :].split("/", 1)[0])
        return sorted(names)

    async def list_info(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Like ``list_prefix``, with each object's size and write time. Backends
        that can list sizes override this; the default reads every object."""
        async for key in self.list_prefix(prefix):
            try:
                size = len(await self.get(key))
            except KeyError:
                continue  # deleted since it was listed
            yield ObjectInfo(key, size, None)

    async def close(self) -> None:
        return None

    async def check_open(self) -> None:
        """Raises ``StoreError`` naming what to do when this store cannot be used at
        all (an S3 bucket that is not there), before anything is written; a no-op
        where opening it already said so."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def local_path(self, key: str) -> Path | None:
        """The file on this host that holds the object at ``key``, for readers that
        map it in place (read-only, never written through); None for a backend
        whose objects are not local files."""
        return None
