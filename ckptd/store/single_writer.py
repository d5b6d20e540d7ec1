"""A store without conditional writes, made safe for its one writer process.

``ckptd serve --single-writer`` over a store that ignores ``If-None-Match`` /
``If-Match`` (see ``probe.py``): every write of this process takes a lock on its
key (one of ``STRIPES``) and checks the condition itself, read then write, so
the ranks' concurrent commits through this server still see one winner. Nothing
protects the store from any other writer (a replica, a ``file://`` client, a
second server): that is what the operator promises by asking for it."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from ckptd.errors import NotFound
from ckptd.store.base import ObjectInfo, Store

STRIPES = 256


class SingleWriterStore(Store):
    """``inner`` with its conditional writes checked under this process's locks."""

    cross_process_cas = False

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.durable = inner.durable
        # Per event loop: an asyncio lock belongs to one (the server runs one).
        self._locks: dict[asyncio.AbstractEventLoop, list[asyncio.Lock]] = {}

    def _lock(self, key: str) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        stripes = self._locks.get(loop)
        if stripes is None:
            stripes = self._locks[loop] = [asyncio.Lock() for _ in range(STRIPES)]
        return stripes[zlib.crc32(key.encode("utf-8")) % STRIPES]

    async def _current(self, key: str) -> bytes | None:
        try:
            return await self.inner.get(key)
        except NotFound:
            return None

    # -- writes: under the key's lock, the condition checked here ----------------------

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        async with self._lock(key):
            if await self.inner.exists(key):
                return False
            return await self.inner.put_if_absent(key, data)

    async def put_content(self, key: str, data: bytes | memoryview,
                          verify: Callable[[], None] | None = None) -> bool:
        async with self._lock(key):
            if await self.inner.exists(key):
                if verify is not None:
                    await asyncio.to_thread(verify)
                return False
            return await self.inner.put_content(key, data, verify)

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        async with self._lock(key):
            if await self._current(key) != expected:
                return False
            if expected is None:
                return await self.inner.put_if_absent(key, new)
            return await self.inner.compare_and_swap(key, expected, new)

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        async with self._lock(key):
            return await self.inner.compare_and_delete(key, expected)

    async def delete(self, key: str) -> None:
        async with self._lock(key):
            await self.inner.delete(key)

    # -- reads: as they are -----------------------------------------------------------

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return await self.inner.exists_many(keys)

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        return self.inner.list_prefix(prefix)

    async def list_dir(self, prefix: str) -> list[str]:
        return await self.inner.list_dir(prefix)

    def list_info(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        return self.inner.list_info(prefix)

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)
