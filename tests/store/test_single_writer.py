"""The single-writer wrapper against the store contract, and the probe of
conditional writes over the stores that have them (issue 20, item 2; the store
that lacks them, an S3 front, is in tests/hostile/test_store_conditions.py)."""

from __future__ import annotations

import asyncio
import os
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


async def test_the_probe_leaves_no_file_in_a_store_directory(tmp_path: Path) -> None:
    # Every start of every replica probes: two lock files each were left in .locks/.
    root = tmp_path / "s"
    for _ in range(3):
        assert await conditional_write_gaps(LocalStore(root)) == []
    left = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
    assert left == []


class _RacingSwapsAllLose(MemoryStore):
    """Conditional writes as a store may answer racing ones (S3's 409 to each of
    several in flight): compare-and-swaps of a key that meet in flight all lose."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: dict[str, list[list[bool]]] = {}
        self.lost = 0

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        met = [False]
        flying = self.in_flight.setdefault(key, [])
        for other in flying:
            other[0] = met[0] = True
        flying.append(met)
        try:
            for _ in range(3):
                await asyncio.sleep(0)  # the racers meet here
        finally:
            flying.remove(met)
        if met[0]:
            self.lost += 1
            return False
        return await super().compare_and_swap(key, expected, new)


async def test_racing_writes_that_all_lose_are_no_gap() -> None:
    # Safe (no two winners, nothing overwritten): refusing such a store to serve was
    # a false alarm.
    store = _RacingSwapsAllLose()
    assert await conditional_write_gaps(store) == []
    assert store.lost == 8


class _SwapsNeverWin(MemoryStore):
    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        return False


async def test_the_probe_names_what_a_store_lacks() -> None:
    # A swap that can never win was reported as "a swap from a stale value succeeded":
    # the operator looked for a gateway dropping If-Match.
    gaps = await conditional_write_gaps(_SwapsNeverWin())
    assert any("from the current value of an object nobody else writes failed" in g
               for g in gaps), gaps
    assert not any("stale value succeeded" in g for g in gaps), gaps
