"""A store in this process's memory, for tests and embedding."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

from ckptd.errors import NotFound
from ckptd.store.base import ObjectInfo, Store, check_key, check_prefix


class MemoryStore(Store):
    durable = False
    cross_process_cas = False

    def __init__(self) -> None:
        # A thread lock, not an asyncio one: the store may be used from several loops.
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._written: dict[str, float] = {}  # key -> when it was written (list_info)

    async def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise NotFound(f"no object at {key}", key=key) from None

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        check_key(key)
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = bytes(data)
            self._written[key] = time.time()
            return True

    async def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._objects

    async def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)
            self._written.pop(key, None)

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        check_prefix(prefix)
        with self._lock:
            keys = [k for k in self._objects if k.startswith(prefix)]
        for key in keys:
            yield key

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        check_key(key)
        with self._lock:
            if self._objects.get(key) != expected:
                return False
            self._objects[key] = bytes(new)
            self._written[key] = time.time()
            return True

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        check_key(key)
        with self._lock:
            if self._objects.get(key) != expected:
                return False
            del self._objects[key]
            return True

    def describe(self) -> str:
        return "memory://"

    async def list_info(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        check_prefix(prefix)
        with self._lock:
            infos = [ObjectInfo(k, len(v), self._written.get(k))
                     for k, v in self._objects.items() if k.startswith(prefix)]
        for info in infos:
            yield info
