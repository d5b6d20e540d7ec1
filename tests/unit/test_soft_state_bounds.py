"""A server's soft state about steps goes with the steps (issue 20, the soak's
growing RSS): the chunk ids a tenant's job may know of, the cached commit records
and manifests' ids, and the chunk leases nobody released. Each is held for the
steps the store holds, not for every step the server ever saw."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ckptd.chunk_claims import LEASES_PURGE_FROM, ChunkClaims
from ckptd.repository import Repository
from ckptd.server.store_views import StoreViews, _Lru
from ckptd.server.tenancy import HELD_STEPS, TenantChunks
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank

JOB = "soak"


async def _commit(repo: Repository, step: int) -> set[str]:
    ids: set[str] = set()
    for manifest, chunks in demo_step(JOB, step, 2):
        await put_rank(repo, manifest, chunks)
        ids |= set(chunks)
    await repo.commit(JOB, step)
    return ids


async def _forget(repo: Repository, step: int) -> None:
    for key in [k async for k in repo.store.list_prefix(f"jobs/{JOB}/steps/{step}/")]:
        await repo.store.delete(key)


def test_a_tenants_ids_go_with_the_steps_that_named_them(tmp_path: Path) -> None:
    async def body() -> None:
        repo = Repository(LocalStore(tmp_path / "store", fsync=False))
        views = StoreViews(repo, ttl=1.0)
        tenants = TenantChunks(repo, views)
        first = await _commit(repo, 1)
        second = await _commit(repo, 2)
        # Uploaded ids are held until a manifest names them, then they are the step's.
        for cid in first:
            assert not tenants.uploaded(JOB, cid)
        assert tenants.held(JOB) == (len(first), 0, 0)
        tenants.named(JOB, 1, first)
        assert tenants.held(JOB) == (0, 1, len(first))
        assert await tenants.known(JOB, sorted(first | second)) == first | second  # scanned
        assert tenants.held(JOB)[1] == 2
        # Retention here forgets step 1: ids only it named are not known any more.
        await _forget(repo, 1)
        tenants.forget(JOB, [1])
        views.forget(JOB, [1])
        assert tenants.held(JOB) == (0, 1, len(second))
        # Another replica forgot step 2: the next scan (a question about ids the
        # job is not known to hold) finds it gone from the listing and drops it.
        third = await _commit(repo, 3)
        await _forget(repo, 2)
        assert await tenants.known(JOB, sorted(third)) == third
        assert sorted(tenants._job(JOB).steps) == [3]
        assert tenants.held(JOB) == (0, 1, len(third))
        assert not await tenants.known(JOB, sorted(second - third))
        await repo.close()

    asyncio.run(body())


def test_held_steps_are_bounded_whatever_retention_says(tmp_path: Path) -> None:
    tenants = TenantChunks(Repository(LocalStore(tmp_path, fsync=False)), None)  # type: ignore[arg-type]
    for step in range(HELD_STEPS + 50):
        tenants.named(JOB, step, [f"{step:064x}", "ab" * 32])
    uploaded, steps, named = tenants.held(JOB)
    assert steps == HELD_STEPS and named == HELD_STEPS + 1
    assert min(tenants._job(JOB).steps) == 50


def test_the_chunk_ids_cache_is_bounded_by_ids_and_forgets_steps(tmp_path: Path) -> None:
    lru = _Lru(100, 10, len)
    for i in range(8):
        lru.put(i, frozenset(range(3)))
    assert list(lru) == [5, 6, 7] and lru.held == 9
    lru.put("big", frozenset(range(50)))  # one entry over the weight alone is kept
    assert list(lru) == ["big"] and lru.held == 50
    views = StoreViews(Repository(LocalStore(tmp_path, fsync=False)), ttl=1.0)
    for step in (1, 2):
        for rank in range(3):
            views._chunk_ids.put((JOB, step, rank), frozenset({f"{step}{rank}"}))
    views.forget(JOB, [1])
    assert sorted(views._chunk_ids) == [(JOB, 2, r) for r in range(3)]
    assert views._chunk_ids.held == 3


def test_leases_nobody_released_expire_out_of_memory() -> None:
    claims = ChunkClaims()
    since = claims.begin()
    for n in range(3):
        claims.split([f"{n}-{i}" for i in range(LEASES_PURGE_FROM)], "dead", 0.01, since)
        time.sleep(0.02)
    claims.end(since)
    # Each batch's leases expired before the next: the purge keeps the held ones only.
    assert len(claims._leases) <= 2 * LEASES_PURGE_FROM


def test_a_held_commit_record_is_read_again_once_per_period_whoever_asks() -> None:
    """(Found by review.) Rechecked records (834ec95) were read again by every caller
    at once (a step's ranks asking for their plans together), and, while the store
    did not answer, by every call, each waiting out the store's timeouts."""
    from ckptd.store import MemoryStore
    from ckptd.testing.faults import FaultyStore

    async def body() -> None:
        store = FaultyStore(MemoryStore())
        repo = Repository(store)
        await _commit(repo, 1)
        now = [0.0]
        views = StoreViews(repo, ttl=1.0, clock=lambda: now[0])
        record = "jobs/soak/steps/1/commit.json"
        assert await views.commit(JOB, 1) is not None
        reads = store.count("get", record)
        now[0] += 100.0  # (past every recheck)
        got = await asyncio.gather(*(views.commit(JOB, 1) for _ in range(16)))
        assert all(r is not None for r in got)
        assert store.count("get", record) == reads + 1  # one read for the sixteen
        now[0] += 100.0
        store.fail_at("get", match=record)  # the store does not answer this once
        assert await views.commit(JOB, 1) is not None  # the copy held
        failed = store.count("get", record)
        for _ in range(5):
            assert await views.commit(JOB, 1) is not None
        assert store.count("get", record) == failed  # not asked again before a period

    asyncio.run(body())
