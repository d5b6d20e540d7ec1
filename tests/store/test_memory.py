"""The memory store against the store contract."""

from __future__ import annotations

import pytest

from ckptd.store import MemoryStore, open_store
from ckptd.store.base import Store
from ckptd.testing.store_conformance import StoreConformance


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Store:
        return MemoryStore()


def test_memory_store_says_it_is_neither_durable_nor_shared() -> None:
    store = MemoryStore()
    assert store.durable is False
    assert store.cross_process_cas is False
    assert isinstance(open_store("memory://"), MemoryStore)


async def test_memory_stores_do_not_share_objects() -> None:
    a, b = MemoryStore(), MemoryStore()
    await a.put_if_absent("k", b"1")
    assert not await b.exists("k")
