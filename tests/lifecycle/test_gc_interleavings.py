"""GC and a save, interleaved at every store call of either one (a gated store):
no schedule may commit a step with a hole, lose a committed chunk, or fail a save
with anything but a typed, retryable error after which a plain retry commits."""

from __future__ import annotations

import asyncio

import pytest

from ckptd.errors import GcInProgress, MissingChunks
from ckptd.lifecycle.gc import collect_garbage
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.testing.manifests import Chunks, demo_step, put_rank
from tests.lifecycle.gated import GatedStore, actor

JOB = "job"


async def _setup(store: GatedStore) -> tuple[Repository, list[tuple[object, Chunks]]]:
    """Steps 1 and 2 committed; half of step 3's chunks already stored but named by
    no manifest (garbage a save will be told it need not send); one pure garbage."""
    repo = Repository(store)
    for step in (1, 2):
        for manifest, chunks in demo_step(JOB, step, 2):
            await put_rank(repo, manifest, chunks)
        assert (await repo.commit(JOB, step)).state == "committed"
    parts = demo_step(JOB, 3, 2)
    for _, chunks in parts:
        for cid in sorted(chunks)[::2]:
            await repo.put_chunk(cid, chunks[cid])
    await repo.put_chunk(_garbage_id(), _GARBAGE)
    return repo, parts  # type: ignore[return-value]


_GARBAGE = b"garbage that nothing names"


def _garbage_id() -> str:
    from ckptd.hashing import chunk_id

    return chunk_id(_GARBAGE)


async def _save(repo: Repository, parts: list[tuple[object, Chunks]]) -> str:
    """Step 3 the way the client sends it: ask, send what is missing, manifest, commit."""
    actor.set("save")
    for rank, (manifest, chunks) in enumerate(parts):
        answer = await repo.missing_chunks(sorted(chunks), claimer=f"rank{rank}")
        for cid in answer.missing:
            await repo.put_chunk(cid, chunks[cid])
        await repo.put_manifest(manifest)  # type: ignore[arg-type]
    return (await repo.commit(JOB, 3)).state


async def _gc(store: GatedStore) -> None:
    actor.set("gc")
    await collect_garbage(store, grace=0.0, lease=30.0)


async def _check(repo: Repository, parts: list[tuple[object, Chunks]], saved: object) -> None:
    """Every committed step verifies; a failed save was typed, and a retry commits."""
    actor.set("check")
    if isinstance(saved, BaseException):
        assert isinstance(saved, MissingChunks | GcInProgress), repr(saved)
        for manifest, chunks in parts:  # the retry: sends what is missing now
            await put_rank(repo, manifest, chunks)  # type: ignore[arg-type]
        assert (await repo.commit(JOB, 3)).state == "committed"
    else:
        assert saved == "committed"
    for step in (1, 2, 3):
        report = await repo.verify(JOB, step)
        assert report.ok, (step, report)


async def _one(pause: str, at: int) -> tuple[bool, bool]:
    """Runs one schedule; returns (the paused actor reached its point, save failed)."""
    store = GatedStore(MemoryStore())
    actor.set("setup")
    repo, parts = await _setup(store)
    store.pause_actor, store.pause_at = pause, at
    first = asyncio.create_task(_gc(store) if pause == "gc" else _save(repo, parts))
    reached = asyncio.create_task(store.paused.wait())
    await asyncio.wait({first, reached}, return_when=asyncio.FIRST_COMPLETED)
    other = asyncio.create_task(_save(repo, parts) if pause == "gc" else _gc(store))
    # The other runs to its end, or until it waits for the paused one (a sweep).
    await asyncio.wait({other}, timeout=0.3)
    store.release.set()
    results = await asyncio.gather(first, other, return_exceptions=True)
    reached.cancel()
    saved = results[1] if pause == "gc" else results[0]
    gc_result = results[0] if pause == "gc" else results[1]
    assert not isinstance(gc_result, BaseException), repr(gc_result)
    await _check(repo, parts, saved)
    return store.paused.is_set(), isinstance(saved, BaseException)


@pytest.mark.parametrize("pause", ["gc", "save"])
async def test_every_interleaving_of_a_save_and_a_collection(pause: str) -> None:
    schedules = failed = 0
    for at in range(1, 500):
        reached, save_failed = await _one(pause, at)
        if not reached:
            break  # the paused actor has fewer calls: every point was tried
        schedules += 1
        failed += save_failed
    assert schedules > 10  # the protocol has that many points at least
    # A save that raced a sweep may fail (and its retry commit), but not most of them.
    assert failed < schedules


@pytest.mark.parametrize("grace", [0.0, 0.6])
async def test_a_chunk_reported_present_before_the_mark_survives_the_grace(grace: float
                                                                           ) -> None:
    """A save told "you need not send it" just before a collection began puts its
    manifest within the grace period: the chunk survives. With no grace the same
    save fails cleanly (missing_chunks) instead of committing a hole."""
    store = GatedStore(MemoryStore())
    repo, parts = await _setup(store)
    answers = [await repo.missing_chunks(sorted(c), claimer=f"r{i}")
               for i, (_, c) in enumerate(parts)]
    for answer, (_, chunks) in zip(answers, parts, strict=True):
        for cid in answer.missing:
            await repo.put_chunk(cid, chunks[cid])
    collection = asyncio.create_task(collect_garbage(store, grace=grace, lease=30.0))
    await asyncio.sleep(0.2 if grace else 0.0)
    if not grace:
        await collection
    try:
        for manifest, _ in parts:
            await repo.put_manifest(manifest)  # type: ignore[arg-type]
        state = (await repo.commit(JOB, 3)).state
    except MissingChunks:
        assert not grace
        return
    finally:
        report = await collection
    assert grace and state == "committed"
    assert report.deleted == [_garbage_id()]
    assert (await repo.verify(JOB, 3)).ok
