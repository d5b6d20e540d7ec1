"""The behaviour every ``Store`` backend must have, as tests a backend subclasses.

A backend's test module overrides the ``store`` fixture and inherits the rest::

    class TestLocalStore(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            return LocalStore(tmp_path / "store")

The class name does not start with ``Test``, so pytest collects it only through
its subclasses.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from ckptd.errors import CkptdError, InvalidName, NotFound
from ckptd.store.base import Store

BAD_KEYS = [
    "",
    "/abs",
    "../x",
    "a/../b",
    "a//b",
    "a/./b",
    ".",
    "..",
    "a/",
    "a\\b",
    "a\x00b",
]

BAD_PREFIXES = ["../", "/abs/", "a//b/", "a/../", "../x"]


async def _listed(store: Store, prefix: str) -> list[str]:
    return sorted([key async for key in store.list_prefix(prefix)])


class StoreConformance:
    """Tests of the ``Store`` contract; subclasses provide the ``store`` fixture."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a backend's test class overrides the store fixture")

    # -- get and put_if_absent ------------------------------------------------------

    @pytest.mark.asyncio
    async def test_get_absent_is_not_found(self, store: Store) -> None:
        with pytest.raises(NotFound) as info:
            await store.get("jobs/a/nothing")
        assert isinstance(info.value, KeyError)
        assert isinstance(info.value, CkptdError)
        assert info.value.code == "not_found"

    @pytest.mark.asyncio
    async def test_put_then_get(self, store: Store) -> None:
        assert await store.put_if_absent("a/b/c", b"hello") is True
        data = await store.get("a/b/c")
        assert data == b"hello"
        assert isinstance(data, bytes)

    @pytest.mark.asyncio
    async def test_second_put_is_refused_and_keeps_the_first(self, store: Store) -> None:
        assert await store.put_if_absent("k", b"first") is True
        assert await store.put_if_absent("k", b"second") is False
        assert await store.put_if_absent("k", b"first") is False
        assert await store.get("k") == b"first"

    @pytest.mark.asyncio
    async def test_put_content_verifies_before_it_writes(self, store: Store) -> None:
        """``put_content``'s ``verify`` runs once, before a byte is written, and
        also when the object is there already; what it raises ends the put with
        nothing written."""
        calls: list[str] = []

        def ok() -> None:
            calls.append("ok")

        def refuse() -> None:
            calls.append("refused")
            raise ValueError("bytes do not hash to their key")

        with pytest.raises(ValueError):
            await store.put_content("content/a", b"wrong", refuse)
        assert not await store.exists("content/a")
        assert await store.put_content("content/a", b"right", ok) is True
        assert await store.get("content/a") == b"right"
        with pytest.raises(ValueError):  # (there already: still checked)
            await store.put_content("content/a", b"wrong", refuse)
        assert await store.put_content("content/a", b"right", ok) is False
        assert calls == ["refused", "ok", "refused", "ok"]
        assert await store.get("content/a") == b"right"

    @pytest.mark.asyncio
    async def test_put_takes_buffers_and_copies_them(self, store: Store) -> None:
        buf = bytearray(b"abcdef")
        assert await store.put_if_absent("buf/bytearray", memoryview(buf)) is True
        buf[0:3] = b"XYZ"  # the store holds what was put, not a view of the caller's memory
        assert await store.get("buf/bytearray") == b"abcdef"
        view = memoryview(b"0123456789")[2:6]
        assert await store.put_if_absent("buf/view", view) is True
        assert await store.get("buf/view") == b"2345"

    @pytest.mark.asyncio
    async def test_empty_object(self, store: Store) -> None:
        assert await store.put_if_absent("empty", b"") is True
        assert await store.get("empty") == b""
        assert await store.exists("empty")

    @pytest.mark.asyncio
    async def test_unicode_and_dotted_names(self, store: Store) -> None:
        keys = ["jobs/résumé/x", "a/.hidden", "a/..double", "a/b.json"]
        for i, key in enumerate(keys):
            assert await store.put_if_absent(key, bytes([i]))
        for i, key in enumerate(keys):
            assert await store.get(key) == bytes([i])

    @pytest.mark.asyncio
    async def test_large_object(self, store: Store) -> None:
        data = os.urandom(8 * 1024 * 1024)
        assert await store.put_if_absent("big/object", data) is True
        assert await store.get("big/object") == data
        assert await store.put_if_absent("big/object", b"small") is False
        assert await store.get("big/object") == data

    @pytest.mark.asyncio
    async def test_a_key_below_an_object_is_absent(self, store: Store) -> None:
        await store.put_if_absent("file", b"x")
        with pytest.raises(NotFound):
            await store.get("file/below")
        assert not await store.exists("file/below")

    @pytest.mark.asyncio
    async def test_a_key_above_objects_is_not_an_object(self, store: Store) -> None:
        await store.put_if_absent("dir/a", b"x")
        with pytest.raises(NotFound):
            await store.get("dir")
        assert not await store.exists("dir")

    # -- exists, exists_many, delete -------------------------------------------------

    @pytest.mark.asyncio
    async def test_exists(self, store: Store) -> None:
        assert not await store.exists("x/y")
        await store.put_if_absent("x/y", b"1")
        assert await store.exists("x/y")
        assert not await store.exists("x/y2")

    @pytest.mark.asyncio
    async def test_exists_many_keeps_order(self, store: Store) -> None:
        await store.put_if_absent("m/1", b"1")
        await store.put_if_absent("m/3", b"3")
        keys = ["m/3", "m/2", "m/1", "m/1", "n/1"]
        assert await store.exists_many(keys) == [True, False, True, True, False]
        assert await store.exists_many([]) == []
        assert await store.exists_many(iter(["m/1"])) == [True]

    @pytest.mark.asyncio
    async def test_delete(self, store: Store) -> None:
        await store.put_if_absent("d/x", b"1")
        await store.delete("d/x")
        assert not await store.exists("d/x")
        with pytest.raises(NotFound):
            await store.get("d/x")
        assert await _listed(store, "d/") == []
        # and the name can be written again
        assert await store.put_if_absent("d/x", b"2") is True
        assert await store.get("d/x") == b"2"

    @pytest.mark.asyncio
    async def test_delete_absent_is_fine(self, store: Store) -> None:
        await store.delete("never/was")
        await store.delete("never/was")

    # -- listing ----------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_list_prefix(self, store: Store) -> None:
        keys = ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/ac/ac01", "jobs/j/steps/1/x"]
        for key in keys:
            await store.put_if_absent(key, b"")
        assert await _listed(store, "") == sorted(keys)
        assert await _listed(store, "chunks/") == keys[:3]
        assert await _listed(store, "chunks/ab/") == keys[:2]
        assert await _listed(store, "jobs/j/steps/") == keys[3:]
        assert await _listed(store, "nothing/") == []
        assert await _listed(store, "chunks/zz/") == []

    @pytest.mark.asyncio
    async def test_list_prefix_ending_inside_a_name(self, store: Store) -> None:
        keys = ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/ac/ac01", "chunksx/1"]
        for key in keys:
            await store.put_if_absent(key, b"")
        assert await _listed(store, "chunks/a") == keys[:3]
        assert await _listed(store, "chunks/ab/ab0") == keys[:2]
        assert await _listed(store, "chunks/ab/ab01") == keys[:1]
        assert await _listed(store, "chunks") == keys
        assert await _listed(store, "chunks/ab/ab03") == []

    @pytest.mark.asyncio
    async def test_list_prefix_is_deep(self, store: Store) -> None:
        keys = ["n/1", "n/a/2", "n/a/b/3", "n/a/b/c/d/e/4"]
        for key in keys:
            await store.put_if_absent(key, b"")
        assert await _listed(store, "n/") == keys
        assert await _listed(store, "n/a/b/") == keys[2:]

    @pytest.mark.asyncio
    async def test_list_dir(self, store: Store) -> None:
        keys = ["jobs/a/steps/1/ranks/0.json", "jobs/a/steps/10/commit.json", "jobs/b/refs/latest"]
        for key in keys:
            await store.put_if_absent(key, b"")
        assert await store.list_dir("jobs/") == ["a", "b"]
        assert await store.list_dir("jobs/a/steps/") == ["1", "10"]
        assert await store.list_dir("jobs/a/steps/10/") == ["commit.json"]
        assert await store.list_dir("jobs/a/steps/1/") == ["ranks"]
        assert await store.list_dir("jobs/zzz/") == []
        assert await store.list_dir("") == ["jobs"]

    @pytest.mark.asyncio
    async def test_list_dir_forgets_names_whose_objects_are_deleted(self, store: Store) -> None:
        await store.put_if_absent("jobs/a/steps/1/ranks/0.json", b"")
        await store.put_if_absent("jobs/a/steps/2/ranks/0.json", b"")
        await store.delete("jobs/a/steps/1/ranks/0.json")
        assert await store.list_dir("jobs/a/steps/") == ["2"]
        await store.delete("jobs/a/steps/2/ranks/0.json")
        assert await store.list_dir("jobs/a/steps/") == []
        assert await store.list_dir("jobs/") == []

    # -- compare_and_delete -------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_compare_and_delete(self, store: Store) -> None:
        assert await store.compare_and_delete("refs/r", b"v1") is False  # absent
        await store.compare_and_swap("refs/r", None, b"v1")
        assert await store.compare_and_delete("refs/r", b"v0") is False
        assert await store.get("refs/r") == b"v1"
        assert await store.compare_and_delete("refs/r", b"v1") is True
        assert not await store.exists("refs/r")

    # -- compare_and_swap ---------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_cas_creates_from_absent(self, store: Store) -> None:
        assert await store.compare_and_swap("refs/r", None, b"v1") is True
        assert await store.get("refs/r") == b"v1"
        assert await store.compare_and_swap("refs/r", None, b"v2") is False  # not absent now
        assert await store.get("refs/r") == b"v1"

    @pytest.mark.asyncio
    async def test_cas_with_wrong_expected_fails(self, store: Store) -> None:
        assert await store.compare_and_swap("refs/r", b"v0", b"v1") is False  # absent
        assert not await store.exists("refs/r")
        await store.compare_and_swap("refs/r", None, b"v1")
        assert await store.compare_and_swap("refs/r", b"v0", b"v2") is False
        assert await store.compare_and_swap("refs/r", b"v1x", b"v2") is False
        assert await store.compare_and_swap("refs/r", b"", b"v2") is False
        assert await store.get("refs/r") == b"v1"

    @pytest.mark.asyncio
    async def test_cas_with_right_expected_succeeds(self, store: Store) -> None:
        await store.compare_and_swap("refs/r", None, b"v1")
        assert await store.compare_and_swap("refs/r", b"v1", b"v2") is True
        assert await store.get("refs/r") == b"v2"
        assert await store.compare_and_swap("refs/r", b"v2", b"v2") is True  # same value
        assert await store.get("refs/r") == b"v2"
        assert await _listed(store, "refs/") == ["refs/r"]

    @pytest.mark.asyncio
    async def test_concurrent_cas_has_one_winner_per_round(self, store: Store) -> None:
        key = "jobs/j/refs/latest"
        await store.compare_and_swap(key, None, b"round-0")
        current = b"round-0"
        for round_ in range(1, 6):
            proposals = [f"round-{round_}-task-{t}".encode() for t in range(16)]
            results = await asyncio.gather(
                *(store.compare_and_swap(key, current, p) for p in proposals)
            )
            assert sum(results) == 1, f"round {round_}: {sum(results)} winners"
            winner = proposals[results.index(True)]
            assert await store.get(key) == winner
            current = winner

    @pytest.mark.asyncio
    async def test_concurrent_put_if_absent_has_one_winner(self, store: Store) -> None:
        for round_ in range(3):
            key = f"chunks/00/race-{round_}"
            bodies = [f"body-{t}".encode() * 1000 for t in range(16)]
            results = await asyncio.gather(*(store.put_if_absent(key, b) for b in bodies))
            assert sum(results) == 1
            assert await store.get(key) == bodies[results.index(True)]

    # -- names ---------------------------------------------------------------------------

    @pytest.mark.asyncio
    @pytest.mark.parametrize("key", BAD_KEYS)
    async def test_bad_keys_are_refused(self, store: Store, key: str) -> None:
        with pytest.raises(InvalidName):
            await store.get(key)
        with pytest.raises(InvalidName):
            await store.put_if_absent(key, b"x")
        with pytest.raises(InvalidName):
            await store.exists(key)
        with pytest.raises(InvalidName):
            await store.exists_many(["ok", key])
        with pytest.raises(InvalidName):
            await store.delete(key)
        with pytest.raises(InvalidName):
            await store.compare_and_swap(key, None, b"x")
        assert await _listed(store, "") == []  # nothing was written anywhere

    @pytest.mark.asyncio
    @pytest.mark.parametrize("prefix", BAD_PREFIXES)
    async def test_bad_prefixes_are_refused(self, store: Store, prefix: str) -> None:
        with pytest.raises(InvalidName):
            await _listed(store, prefix)
        with pytest.raises(InvalidName):
            await store.list_dir(prefix if prefix.endswith("/") else prefix + "/")

    @pytest.mark.asyncio
    async def test_invalid_name_is_a_value_error(self, store: Store) -> None:
        with pytest.raises(ValueError):
            await store.get("../etc/passwd")

    # -- the rest -----------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_describe_and_flags(self, store: Store) -> None:
        assert isinstance(store.describe(), str) and store.describe()
        assert isinstance(store.durable, bool)
        assert isinstance(store.cross_process_cas, bool)
        await store.close()
