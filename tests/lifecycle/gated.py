"""A store wrapper that pauses one actor at its n-th store call, so that a test can
run another actor to completion at exactly that point (every interleaving point of
two protocols, one by one, like the claims race test in test_repository.py)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Iterable

from ckptd.store.base import ObjectInfo, Store

actor: contextvars.ContextVar[str] = contextvars.ContextVar("actor", default="")


class GatedStore(Store):
    """Counts each actor's calls; pauses ``pause_actor`` before its ``pause_at``-th."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.durable = inner.durable
        self.cross_process_cas = inner.cross_process_cas
        self.calls: dict[str, int] = {}
        self.pause_actor = ""
        self.pause_at = 0
        self.paused = asyncio.Event()
        self.release = asyncio.Event()
        self.trace: list[tuple[str, str, str]] = []

    async def _gate(self, op: str, key: str) -> None:
        who = actor.get()
        n = self.calls[who] = self.calls.get(who, 0) + 1
        self.trace.append((who, op, key))
        if who and who == self.pause_actor and n == self.pause_at:
            self.paused.set()
            await self.release.wait()

    async def get(self, key: str) -> bytes:
        await self._gate("get", key)
        return await self.inner.get(key)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        await self._gate("put_if_absent", key)
        return await self.inner.put_if_absent(key, data)

    async def exists(self, key: str) -> bool:
        await self._gate("exists", key)
        return await self.inner.exists(key)

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        await self._gate("exists_many", keys[0] if keys else "")
        return await self.inner.exists_many(keys)

    async def delete(self, key: str) -> None:
        await self._gate("delete", key)
        await self.inner.delete(key)

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        await self._gate("list_prefix", prefix)
        keys = [k async for k in self.inner.list_prefix(prefix)]
        for k in keys:
            yield k

    async def list_info(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        await self._gate("list_info", prefix)
        infos = [i async for i in self.inner.list_info(prefix)]
        for i in infos:
            yield i

    async def list_dir(self, prefix: str) -> list[str]:
        await self._gate("list_dir", prefix)
        return await self.inner.list_dir(prefix)

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        await self._gate("compare_and_swap", key)
        return await self.inner.compare_and_swap(key, expected, new)
