"""The fault-injecting wrapper: transparent until armed, then exact."""

from __future__ import annotations

import pytest

from ckptd.errors import InvalidRequest, StoreError, Timeout
from ckptd.store import MemoryStore
from ckptd.store.base import Store
from ckptd.testing.faults import FaultyStore
from ckptd.testing.store_conformance import StoreConformance


class TestFaultyStoreUnarmed(StoreConformance):
    """Unarmed, the wrapper is the store it wraps."""

    @pytest.fixture
    def store(self) -> Store:
        return FaultyStore(MemoryStore())


async def test_fails_the_nth_call_once_and_counts() -> None:
    store = FaultyStore(MemoryStore())
    store.fail_at("put_if_absent", nth=3)
    assert await store.put_if_absent("a", b"1")
    assert await store.put_if_absent("b", b"2")
    with pytest.raises(StoreError):
        await store.put_if_absent("c", b"3")
    assert not await store.inner.exists("c")  # failed before reaching the store
    assert await store.put_if_absent("c", b"3")  # one-shot
    assert store.calls["put_if_absent"] == 4
    assert store.failures["put_if_absent"] == 1
    assert store.armed == 0


async def test_match_selects_keys() -> None:
    store = FaultyStore(MemoryStore())
    fault = store.fail_at("put_if_absent", match="/commit.json")
    await store.put_if_absent("jobs/j/steps/1/ranks/0.json", b"m")
    assert not fault.fired
    with pytest.raises(StoreError):
        await store.put_if_absent("jobs/j/steps/1/commit.json", b"c")
    assert fault.fired
    store.fail_at("get", match=lambda k: k.endswith("/latest"))
    await store.inner.put_if_absent("jobs/j/refs/latest", b"r")
    assert await store.get("jobs/j/steps/1/ranks/0.json") == b"m"
    with pytest.raises(StoreError):
        await store.get("jobs/j/refs/latest")
    assert store.count("get") == 2
    assert store.count("get", match="latest") == 1
    assert store.count("put_if_absent", match="commit") == 1


async def test_after_means_the_write_happened() -> None:
    store = FaultyStore(MemoryStore())
    store.fail_at("compare_and_swap", after=True, exc=Timeout)
    with pytest.raises(Timeout):
        await store.compare_and_swap("ref", None, b"1")
    assert await store.inner.get("ref") == b"1"


async def test_custom_exception_instance_and_every_op() -> None:
    store = FaultyStore(MemoryStore())
    await store.put_if_absent("k/x", b"1")
    boom = ConnectionResetError("reset")
    for op in ("get", "exists", "exists_many", "delete", "list_prefix", "list_dir"):
        store.fail_at(op, exc=boom)
    with pytest.raises(ConnectionResetError):
        await store.get("k/x")
    with pytest.raises(ConnectionResetError):
        await store.exists("k/x")
    with pytest.raises(ConnectionResetError):
        await store.exists_many(["k/x"])
    with pytest.raises(ConnectionResetError):
        await store.delete("k/x")
    with pytest.raises(ConnectionResetError):
        _ = [k async for k in store.list_prefix("k/")]
    with pytest.raises(ConnectionResetError):
        await store.list_dir("k/")
    assert sum(store.failures.values()) == 6
    assert await store.get("k/x") == b"1"
    assert store.writes() == 2  # one put, one (failed) delete


async def test_arming_is_checked_and_clear_disarms() -> None:
    store = FaultyStore(MemoryStore())
    with pytest.raises(InvalidRequest):
        store.fail_at("rename")
    with pytest.raises(InvalidRequest):
        store.fail_at("get", nth=0)
    store.fail_at("get")
    assert store.armed == 1
    store.clear()
    assert store.armed == 0
    with pytest.raises(KeyError):
        await store.get("absent")
    assert store.describe() == "faulty+memory://"
