"""The local directory store against the store contract, and what only it does."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from ckptd.errors import InvalidRequest, StoreCorrupt, StoreError
from ckptd.hashing import chunk_id
from ckptd.store import LocalStore, open_store
from ckptd.store.base import Store
from ckptd.testing.store_conformance import StoreConformance


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return LocalStore(tmp_path / "store")


class TestLocalStoreWithoutFsync(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return LocalStore(tmp_path / "store", fsync=False)


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


async def listed(store: LocalStore, prefix: str = "") -> list[str]:
    return sorted([k async for k in store.list_prefix(prefix)])


async def test_a_key_is_a_file_at_that_path(tmp_path: Path) -> None:
    # The format relies on it: `b3sum chunks/ab/ab...` checks a chunk by its name.
    store = LocalStore(tmp_path)
    data = b"chunk bytes"
    cid = chunk_id(data)
    await store.put_if_absent(f"chunks/{cid[:2]}/{cid}", data)
    assert (tmp_path / "chunks" / cid[:2] / cid).read_bytes() == data


async def test_an_object_that_does_not_read_is_damage_named_and_still_listed(
    tmp_path: Path,
) -> None:
    """A file replaced by a link to itself (ELOOP, as a disk's EIO would be): its
    read is StoreCorrupt naming the key, not an OSError with the store's path; it is
    still an object in every listing (a collection may delete it), the rest read."""
    store = LocalStore(tmp_path, fsync=False)
    good, bad = b"good", b"bad"
    gkey, bkey = f"chunks/aa/{chunk_id(good)}", f"chunks/aa/{chunk_id(bad)}"
    await store.put_if_absent(gkey, good)
    await store.put_if_absent(bkey, bad)
    path = tmp_path / bkey
    path.unlink()
    path.symlink_to(path.name)
    with pytest.raises(StoreCorrupt) as caught:
        await store.get(bkey)
    assert caught.value.detail["key"] == bkey and str(tmp_path) not in caught.value.message
    assert await store.get(gkey) == good
    assert await listed(store, "chunks/") == sorted([gkey, bkey])
    assert sorted([i.key async for i in store.list_info("chunks/")]) == sorted([gkey, bkey])
    assert await store.list_dir("chunks/") == ["aa"]
    await store.delete(gkey)
    assert await store.list_dir("chunks/") == ["aa"]  # (the loop is all it holds)
    await store.delete(bkey)
    assert await store.list_dir("chunks/") == [] and not path.is_symlink()


async def test_leftover_temporaries_are_invisible(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    await store.put_if_absent("jobs/j/steps/1/ranks/0.json", b"{}")
    # what a writer killed between its write and its link leaves behind
    (tmp_path / "jobs/j/steps/1/ranks/.tmp-deadbeef").write_bytes(b"half")
    (tmp_path / "jobs/j/steps/2").mkdir(parents=True)
    (tmp_path / "jobs/j/steps/2/.tmp-cafe").write_bytes(b"half")
    (tmp_path / ".tmp-top").write_bytes(b"half")
    assert await listed(store) == ["jobs/j/steps/1/ranks/0.json"]
    assert await listed(store, "jobs/j/steps/1/ranks/.tmp") == []
    assert await store.list_dir("jobs/j/steps/1/ranks/") == ["0.json"]
    assert await store.list_dir("jobs/j/steps/") == ["1"]  # 2 holds only a temporary
    assert await store.list_dir("") == ["jobs"]


async def test_temporaries_never_show_while_writing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    stop = asyncio.Event()
    seen: list[str] = []

    async def watch() -> None:
        while not stop.is_set():
            seen.extend(k for k in await listed(store, "obj/") if ".tmp-" in k)
            seen.extend(n for n in await store.list_dir("obj/") if n.startswith(".tmp-"))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    for i in range(200):
        await store.put_if_absent(f"obj/{i}", os.urandom(64 * 1024))
        await store.compare_and_swap("obj/ref", None if i == 0 else str(i - 1).encode(),
                                     str(i).encode())
    stop.set()
    await watcher
    assert seen == []
    assert tmp_files(tmp_path) == []
    assert len(await listed(store, "obj/")) == 201


async def test_locks_are_not_objects(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    await store.compare_and_swap("jobs/j/refs/latest", None, b"1")
    assert (tmp_path / ".locks").is_dir()
    assert await listed(store) == ["jobs/j/refs/latest"]
    assert await store.list_dir("") == ["jobs"]


@pytest.mark.parametrize("fsync", [True, False])
async def test_fsync_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    calls: list[int] = []
    real = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    store = LocalStore(tmp_path, fsync=fsync)
    await store.put_if_absent("a/b", b"data")
    after_put = len(calls)
    await store.compare_and_swap("a/ref", None, b"1")
    if fsync:
        assert after_put >= 2  # the file, then its directory
        assert len(calls) >= after_put + 2
    else:
        assert calls == []
    assert await store.get("a/b") == b"data"


async def test_a_failed_write_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = LocalStore(tmp_path, fsync=True)
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(StoreError) as info:
        await store.put_if_absent("a/b", b"data")
    assert isinstance(info.value, OSError)
    with pytest.raises(StoreError):
        await store.compare_and_swap("a/ref", None, b"1")
    monkeypatch.undo()
    assert tmp_files(tmp_path) == []
    assert not await store.exists("a/b")
    assert not await store.exists("a/ref")
    assert await store.put_if_absent("a/b", b"data") is True


async def test_new_directories_are_fsynced_into_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptd.store.local as local

    synced: list[Path] = []
    real = local._fsync_dir

    def recording(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(local, "_fsync_dir", recording)
    store = LocalStore(tmp_path, fsync=True)
    root = store.root
    await store.put_if_absent("jobs/j/steps/1/commit.json", b"x")
    # Every directory made for it is named durably in its parent, then the file in its own.
    for made in ("jobs", "jobs/j", "jobs/j/steps", "jobs/j/steps/1"):
        assert (root / made).parent in synced, made
    assert synced[-1] == root / "jobs/j/steps/1"
    synced.clear()
    await store.compare_and_swap("jobs/k/refs/latest", None, b"1")
    assert {root / "jobs", root / "jobs/k", root / "jobs/k/refs"} <= set(synced)


async def test_a_failed_rename_of_a_ref_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path, fsync=False)
    assert await store.compare_and_swap("a/ref", None, b"1")
    failures: list[str] = []

    def failing_replace(src: str, dst: str) -> None:
        failures.append(str(dst))
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(StoreError):
        await store.compare_and_swap("a/ref", b"1", b"2")
    monkeypatch.undo()
    assert len(failures) == 1
    assert tmp_files(tmp_path) == []
    assert await store.get("a/ref") == b"1"


async def test_two_stores_on_one_directory_see_each_other(tmp_path: Path) -> None:
    a, b = LocalStore(tmp_path), LocalStore(tmp_path)
    assert await a.put_if_absent("k", b"from a") is True
    assert await b.put_if_absent("k", b"from b") is False
    assert await b.get("k") == b"from a"
    assert await a.compare_and_swap("ref", None, b"1") is True
    assert await b.compare_and_swap("ref", None, b"2") is False
    assert await b.compare_and_swap("ref", b"1", b"2") is True
    assert await a.get("ref") == b"2"


async def test_concurrent_cas_across_store_objects(tmp_path: Path) -> None:
    stores = [LocalStore(tmp_path, fsync=False) for _ in range(8)]
    await stores[0].compare_and_swap("ref", None, b"0")
    current = b"0"
    for round_ in range(1, 6):
        new = [f"{round_}-{i}".encode() for i in range(len(stores))]
        results = await asyncio.gather(
            *(s.compare_and_swap("ref", current, n) for s, n in zip(stores, new, strict=True))
        )
        assert sum(results) == 1
        current = new[results.index(True)]
        assert await stores[-1].get("ref") == current


async def test_root_is_created_and_must_be_a_directory(tmp_path: Path) -> None:
    LocalStore(tmp_path / "deep" / "er" / "store")
    assert (tmp_path / "deep" / "er" / "store").is_dir()
    (tmp_path / "plain-file").write_bytes(b"")
    with pytest.raises(StoreError):
        LocalStore(tmp_path / "plain-file" / "store")


def test_open_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    s = open_store(f"file://{tmp_path}/x")
    assert isinstance(s, LocalStore) and s.root == (tmp_path / "x").resolve()
    assert s.describe() == f"file://{(tmp_path / 'x').resolve()}"
    with pytest.raises(InvalidRequest):
        open_store("gopher://x")


async def test_local_path_names_the_file_readers_may_map_and_other_backends_have_none(
    tmp_path: Path,
) -> None:
    from ckptd.store import MemoryStore

    store = LocalStore(tmp_path / "s", fsync=False)
    data = b"mapped in place"
    cid = chunk_id(data)
    await store.put_if_absent(f"chunks/{cid[:2]}/{cid}", data)
    path = store.local_path(f"chunks/{cid[:2]}/{cid}")
    assert path is not None and path.read_bytes() == data
    with pytest.raises(InvalidRequest):
        store.local_path("../escape")
    assert MemoryStore().local_path(f"chunks/{cid[:2]}/{cid}") is None


async def test_a_subclass_wrapping_put_if_absent_sees_verified_content_puts(
        tmp_path: Path) -> None:
    """(A store's verified chunk put writes from its own thread.) A subclass that
    wraps ``put_if_absent``, as tests' recording stores do, still sees chunk puts,
    and the verify still runs before anything is written."""
    seen: list[str] = []

    class Recording(LocalStore):
        async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
            seen.append(key)
            return await super().put_if_absent(key, data)

    store = Recording(str(tmp_path))
    checked: list[bool] = []
    assert await store.put_content("chunks/ab/x", b"bytes", lambda: checked.append(True))
    assert seen == ["chunks/ab/x"] and checked == [True]
    def refuse() -> None:
        raise ValueError("bytes do not hash to their key")

    with pytest.raises(ValueError):
        await store.put_content("chunks/ab/y", b"bad", refuse)
    assert seen == ["chunks/ab/x"] and not await store.exists("chunks/ab/y")


async def test_document_reads_do_not_wait_behind_chunk_writes(tmp_path: Path) -> None:
    # A server's chunk puts take milliseconds each (hash, write, fsync): with every
    # default-pool thread busy writing chunks, a manifest read or a listing (a commit,
    # a restore plan) must still be answered at once.
    import threading

    store = LocalStore(tmp_path / "store")
    await store.put_if_absent("jobs/j/doc.json", b"{}")
    release = threading.Event()
    threads = min(32, (os.cpu_count() or 1) + 4)  # the default pool's (and the writers')
    data = [os.urandom(1024) for _ in range(threads)]
    puts = [asyncio.create_task(store.put_content(f"chunks/{chunk_id(d)[:2]}/{chunk_id(d)}", d,
                                                  verify=lambda: release.wait(10)))
            for d in data]
    try:
        await asyncio.sleep(0.2)  # the puts take their threads
        assert not any(p.done() for p in puts)
        assert await asyncio.wait_for(store.get("jobs/j/doc.json"), 2.0) == b"{}"
        assert await asyncio.wait_for(listed(store, "jobs/"), 2.0) == ["jobs/j/doc.json"]
    finally:
        release.set()
        assert all(await asyncio.gather(*puts))
