"""Clearing a rollback is a compare-and-delete (item 11): a rollback set between
the check and the delete survives."""

from __future__ import annotations

import pytest

from ckptd.repository import Repository
from ckptd.store.memory import MemoryStore

KEY = "jobs/j/refs/rollback"


class RacingStore(MemoryStore):
    """A memory store where another replica replaces the rollback marker right
    after this one first looks at it."""

    def __init__(self) -> None:
        super().__init__()
        self.raced = False

    async def _race(self, key: str) -> None:
        if key == KEY and not self.raced:
            self.raced = True
            current = await MemoryStore.get(self, key)
            assert await MemoryStore.compare_and_swap(self, key, current, b"newer")

    async def exists(self, key: str) -> bool:
        found = await super().exists(key)
        await self._race(key)
        return found

    async def get(self, key: str) -> bytes:
        data = await super().get(key)
        await self._race(key)
        return data


@pytest.mark.asyncio
async def test_clear_keeps_a_newer_rollback() -> None:
    store = RacingStore()
    await store.compare_and_swap(KEY, None, b"older")
    repo = Repository(store)
    cleared = await repo.clear_rollback("j")
    assert store.raced
    assert cleared is False
    assert await store.get(KEY) == b"newer"


@pytest.mark.asyncio
async def test_clear_removes_the_marker_it_saw() -> None:
    store = MemoryStore()
    await store.compare_and_swap(KEY, None, b"older")
    assert await Repository(store).clear_rollback("j") is True
    assert not await store.exists(KEY)
