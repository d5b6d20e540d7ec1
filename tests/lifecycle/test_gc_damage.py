"""A damaged GC document is store damage: a 500 ``store_corrupt`` naming it, never
a 400 blaming the caller. A damaged ``gc/state`` stops saves (it cannot say whether
a sweep is deleting) until a collection takes it over and repairs it; a damaged
rank manifest or touched document stops a collection before it deletes anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from ckptd.errors import GcInProgress, StoreCorrupt, UnsupportedFormat
from ckptd.format import chunk_key, manifest_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState, touched_prefix
from ckptd.lifecycle.fence import read_state
from ckptd.lifecycle.gc import collect_garbage
from ckptd.lifecycle.retention import RetentionPolicy, forget
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess

JOB = "job"
DAMAGED_STATE = b'{"format":"ckptd.gc_state","generation":5,"vers'
GARBAGE = b"garbage that nothing names"


async def _one_step(repo: Repository) -> None:
    for manifest, chunks in demo_step(JOB, 1, 1):
        await put_rank(repo, manifest, chunks)
    assert (await repo.commit(JOB, 1)).state == "committed"


async def test_a_damaged_gc_state_fails_saves_as_store_damage() -> None:
    store = MemoryStore()
    repo = Repository(store)
    (manifest, chunks), = demo_step(JOB, 1, 1)
    for cid, data in chunks.items():
        await repo.put_chunk(cid, data)
    await store.put_if_absent(GC_STATE_KEY, DAMAGED_STATE)
    with pytest.raises(StoreCorrupt) as missing:
        await repo.missing_chunks(sorted(chunks), claimer="r0")
    with pytest.raises(StoreCorrupt) as put:
        await repo.put_manifest(manifest)
    for exc in (missing, put):
        assert exc.value.detail["key"] == GC_STATE_KEY


async def test_a_collection_takes_a_damaged_gc_state_over_and_repairs_it() -> None:
    """It swaps the damaged bytes for a sweep of its own that deletes nothing (writers
    wait, not fail), holds it one lease in case a collector was mid-sweep, then
    collects as usual with a generation above any the store shows."""
    store = MemoryStore()
    repo = Repository(store)
    await _one_step(repo)
    await repo.put_chunk(chunk_id(GARBAGE), GARBAGE)
    await store.put_if_absent(f"{touched_prefix(7)}{'0' * 32}",
                              b'{"format":"ckptd.gc_touched","generation":7,"ids":[],"version":1}')
    await store.put_if_absent(GC_STATE_KEY, DAMAGED_STATE)
    lease = 0.4
    t0 = time.monotonic()
    gc = asyncio.create_task(collect_garbage(store, grace=0.0, lease=lease))
    while True:  # the damaged state is taken over: writers wait for it
        try:
            state, _ = await read_state(store)
            break
        except StoreCorrupt:
            await asyncio.sleep(0.01)
    assert state.phase == "sweeping" and state.generation == 8
    answer = await repo.missing_chunks([chunk_id(b"new")])
    assert answer.missing == [chunk_id(b"new")]
    report = await asyncio.wait_for(gc, 10)
    assert time.monotonic() - t0 >= lease  # it held the fence one lease
    assert report.generation == 8 and report.chunks_deleted == 1
    assert not await store.exists(chunk_key(chunk_id(GARBAGE)))
    assert (await read_state(store))[0].phase == "idle"
    assert (await repo.verify(JOB, 1)).ok


async def test_a_gc_state_of_a_newer_format_version_is_not_taken_over() -> None:
    store = MemoryStore()
    newer = (b'{"expires_at":0,"format":"ckptd.gc_state","generation":1,"holder":"",'
             b'"phase":"idle","started_at":0,"version":9}')
    await store.put_if_absent(GC_STATE_KEY, newer)
    # A newer ckptd's document: unsupported_format naming it (upgrade), never damage.
    with pytest.raises(UnsupportedFormat) as exc:
        await collect_garbage(store, grace=0.0, lease=0.2)
    assert exc.value.detail["key"] == GC_STATE_KEY
    assert await store.get(GC_STATE_KEY) == newer


async def test_a_damaged_manifest_stops_the_collection_as_store_damage() -> None:
    store = MemoryStore()
    repo = Repository(store)
    await _one_step(repo)
    await repo.put_chunk(chunk_id(GARBAGE), GARBAGE)
    bad = "jobs/other/steps/3/ranks/0.json"
    await store.put_if_absent(bad, b'{"format":"ckptd.rank_manifest",')
    chunks_before = [k async for k in store.list_prefix("chunks/")]
    with pytest.raises(StoreCorrupt) as exc:
        await collect_garbage(store, grace=0.0)
    assert exc.value.detail["key"] == bad
    assert [k async for k in store.list_prefix("chunks/")] == chunks_before  # nothing went
    assert (await read_state(store))[0].phase == "idle"  # the lease was handed back


async def test_a_damaged_touched_document_stops_the_sweep_and_the_next_one_clears_it(
) -> None:
    store = MemoryStore()
    repo = Repository(store)
    await repo.put_chunk(chunk_id(GARBAGE), GARBAGE)
    bad = f"{touched_prefix(1)}{'1' * 32}"
    await store.put_if_absent(bad, b'{"format":"ckptd.gc_touched",')
    with pytest.raises(StoreCorrupt) as exc:
        await collect_garbage(store, grace=0.0)
    assert exc.value.detail["key"] == bad
    assert await store.exists(chunk_key(chunk_id(GARBAGE)))
    report = await collect_garbage(store, grace=0.0)  # generation 2 forgets generation 1's
    assert report.chunks_deleted == 1 and not await store.exists(bad)


def _damage(root: Path, key: str, data: bytes) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_the_server_answers_a_damaged_gc_document_with_a_500_naming_it(
    server: ServerProcess,
) -> None:
    root = Path(server.store)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        bad = "jobs/j/steps/3/ranks/0.json"
        _damage(root, bad, b'{"format":"ckptd.rank_manifest",')
        r = client.post("/v1/gc", params={"grace": 0})
        assert r.status_code == 500, r.text
        assert r.json()["code"] == "store_corrupt" and r.json()["detail"]["key"] == bad
        _damage(root, GC_STATE_KEY, DAMAGED_STATE)
        r = client.post("/v1/chunks/missing", json={"ids": ["0" * 64], "claimer": "a"})
        assert r.status_code == 500, r.text
        assert r.json()["code"] == "store_corrupt"
        assert r.json()["detail"]["key"] == GC_STATE_KEY


class RepairedMeanwhile(MemoryStore):
    """The first read of ``gc/state`` finds it damaged; another collection has
    taken it over by the time this one reads it again."""

    def __init__(self) -> None:
        super().__init__()
        self.first = True

    async def get(self, key: str) -> bytes:
        if key == GC_STATE_KEY and self.first:
            self.first = False
            return DAMAGED_STATE
        return await super().get(key)


async def test_a_collection_does_not_take_over_a_state_another_just_repaired() -> None:
    store = RepairedMeanwhile()
    theirs = GcState(generation=6, phase="sweeping", holder="other", started_at=time.time(),
                     expires_at=time.time() + 60).canonical()
    await store.put_if_absent(GC_STATE_KEY, theirs)
    with pytest.raises(GcInProgress):
        await collect_garbage(store, grace=0.0, lease=0.3)
    assert await store.get(GC_STATE_KEY) == theirs



class ForgottenWhileMarking(MemoryStore):
    """Runs ``during`` (another server's retention) just before the first read of
    ``key``, a rank manifest the collection's commit records name."""

    def __init__(self) -> None:
        super().__init__()
        self.key = ""
        self.during: Callable[[], Awaitable[None]] | None = None

    async def get(self, key: str) -> bytes:
        if key == self.key and self.during is not None:
            during, self.during = self.during, None
            await during()
        return await super().get(key)


@pytest.mark.parametrize("anew", [False, True], ids=["forgotten", "committed-anew"])
async def test_a_step_forgotten_while_the_collection_marks_is_not_damage(anew: bool) -> None:
    """A committed step's manifest missing (or other bytes) stops a collection only
    while the record that named it is still there: retention removing the step
    meanwhile (record first, then manifests), and a commit of it anew, is no damage."""
    store = ForgottenWhileMarking()
    repo = Repository(store)
    for step in (1, 2):
        for manifest, chunks in demo_step(JOB, step, 1):
            await put_rank(repo, manifest, chunks)
        assert (await repo.commit(JOB, step)).state == "committed"
    (_, first), = demo_step(JOB, 1, 1)
    (_, second), = demo_step(JOB, 2, 1)
    only_first = set(first) - set(second)
    store.key = manifest_key(JOB, 1, 0)

    async def retention() -> None:
        assert (await forget(repo, JOB, RetentionPolicy(keep_last=1))).forgotten == [1]
        if anew:
            for manifest, chunks in demo_step(JOB, 1, 1, seed="anew"):
                await put_rank(repo, manifest, chunks)
            assert (await repo.commit(JOB, 1)).state == "committed"

    store.during = retention
    report = await collect_garbage(store, grace=0.0)
    assert store.during is None  # the step went while the collection marked
    assert set(report.deleted) == only_first and only_first
    assert (await repo.verify(JOB, 2)).ok
    if anew:
        assert (await repo.verify(JOB, 1)).ok


async def test_a_manifest_of_a_newer_format_version_stops_the_collection_for_an_upgrade(
        ) -> None:
    """A newer ckptd's manifest of a step in flight is no damage to forget: gc said
    'does not parse ... forget that step', which would drop another version's save."""
    store = MemoryStore()
    repo = Repository(store)
    await _one_step(repo)
    await repo.put_chunk(chunk_id(GARBAGE), GARBAGE)
    manifest, _ = next(iter(demo_step(JOB, 3, 1)))
    key = manifest_key(JOB, 3, 0)
    newer = manifest.canonical().replace(b'"version":1', b'"version":9')
    assert newer != manifest.canonical()
    await store.put_if_absent(key, newer)
    chunks_before = [k async for k in store.list_prefix("chunks/")]
    with pytest.raises(UnsupportedFormat) as exc:
        await collect_garbage(store, grace=0.0)
    assert not isinstance(exc.value, StoreCorrupt)
    assert exc.value.detail["key"] == key
    assert "upgrade" in exc.value.message and "forget" not in exc.value.message
    assert [k async for k in store.list_prefix("chunks/")] == chunks_before
