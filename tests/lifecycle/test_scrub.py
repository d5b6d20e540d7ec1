"""Scrub over memory, local and S3 stores: repair from a replica, damage markers
that restore of latest skips, and a rolling cursor within an I/O budget."""

from __future__ import annotations

from ckptd.format import chunk_key
from ckptd.lifecycle.retention import RetentionPolicy, forget
from ckptd.lifecycle.scrub import damaged_steps, scrub, store_source
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.store.base import Store
from ckptd.testing.manifests import demo_step, put_rank

JOB = "job"


async def _steps(repo: Repository, *steps: int) -> dict[int, list[str]]:
    """Commits ``steps``; returns each step's chunk ids (rank 0's model.w first)."""
    out = {}
    for step in steps:
        parts = demo_step(JOB, step, 2)
        for manifest, chunks in parts:
            await put_rank(repo, manifest, chunks)
        assert (await repo.commit(JOB, step)).state == "committed"
        out[step] = list(parts[0][0].entries[0].chunks)
    return out


async def _corrupt(store: Store, cid: str) -> bytes:
    good = await store.get(chunk_key(cid))
    bad = bytes([good[0] ^ 1]) + good[1:]
    assert await store.compare_and_swap(chunk_key(cid), good, bad)
    return good


async def test_scrub_repairs_from_a_replica_and_marks_what_it_cannot(any_store: Store) -> None:
    repo = Repository(any_store)
    ids = await _steps(repo, 1, 2, 3)
    replica = MemoryStore()
    fixable, lost = ids[2][0], ids[3][0]
    good = await _corrupt(any_store, fixable)
    await replica.put_if_absent(chunk_key(fixable), good)
    await _corrupt(any_store, lost)
    assert await repo.latest(JOB) == 3

    report = await scrub(repo, sources=[store_source(replica)])
    assert sorted(report.corrupt) == sorted([fixable, lost])
    assert report.repaired == [fixable]
    assert report.damaged == {JOB: [3]}
    assert (await repo.verify(JOB, 2)).ok
    assert await damaged_steps(repo, JOB) == {3: [lost]}
    assert await repo.latest(JOB) == 2  # restore of latest skips the damaged step
    assert await repo.resolve_step(JOB, None) == 2
    assert await repo.latest_ref_step(JOB) == 3
    again = await scrub(repo, sources=[store_source(replica)])
    assert again.corrupt == [lost] and again.repaired == []
    # Retention keeps what restore of latest gets, not only what the ref names.
    plan = await forget(repo, JOB, RetentionPolicy(keep_last=1))
    assert plan.forgotten == [1]
    assert {d.step: d.reasons for d in plan.steps}[2] == ("newest undamaged (restore of latest)",)


async def test_scrub_resumes_where_it_stopped_within_a_budget(any_store: Store) -> None:
    repo = Repository(any_store)
    await _steps(repo, 1, 2)
    total = [k async for k in any_store.list_prefix("chunks/")]
    first = await scrub(repo, budget_bytes=4096 * 3)
    assert 3 <= first.chunks_checked < len(total)
    second = await scrub(repo, budget_bytes=None)
    # The rest of the ring first, then the chunks the first run saw: each once.
    assert second.chunks_checked == len(total) and second.passes_completed == 1
    assert first.bytes_checked + second.bytes_checked >= sum(
        [len(await any_store.get(k)) for k in total])


async def test_scrub_replaces_a_damaged_damage_marker() -> None:
    from ckptd.lifecycle.documents import damage_key

    store = MemoryStore()
    repo = Repository(store)
    ids = await _steps(repo, 1)
    await _corrupt(store, ids[1][0])
    await store.put_if_absent(damage_key(JOB, 1), b'{"format":"ckptd.dam')
    report = await scrub(repo)  # not a 400 invalid_document: the marker is rewritten
    assert report.damaged == {JOB: [1]}
    assert await damaged_steps(repo, JOB) == {1: [ids[1][0]]}
