"""The single-writer wrapper against the store contract, and the probe of
conditional writes over the stores that have them (issue 20, item 2; the store
that lacks them, an S3 front, is in tests/hostile/test_store_conditions.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.store import LocalStore, MemoryStore
from ckptd.store.base import Store
from ckptd.store.probe import PROBE_PREFIX, conditional_write_gaps
from ckptd.store.single_writer import SingleWriterStore
from ckptd.testing.store_conformance import StoreConformance


class TestSingleWriterStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return SingleWriterStore(LocalStore(tmp_path / "store"))


@pytest.mark.parametrize("kind", ["memory", "local", "single-writer"])
async def test_stores_with_conditional_writes_pass_the_probe(kind: str, tmp_path: Path) -> None:
    stores: dict[str, Callable[[], Store]] = {
        "memory": MemoryStore, "local": lambda: LocalStore(tmp_path / "s"),
        "single-writer": lambda: SingleWriterStore(MemoryStore())}
    store = stores[kind]()
    assert await conditional_write_gaps(store) == []
    assert [k async for k in store.list_prefix(PROBE_PREFIX)] == []  # nothing left
