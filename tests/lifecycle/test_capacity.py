"""Capacity views, the store-full guard, and housekeeping of temporary files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptd.errors import StoreFull, http_status
from ckptd.hashing import chunk_id
from ckptd.lifecycle.capacity import SpaceGuard
from ckptd.lifecycle.census import census
from ckptd.lifecycle.housekeeping import remove_stale_temporaries
from ckptd.repository import Repository
from ckptd.store import LocalStore, MemoryStore
from ckptd.store.base import Store
from ckptd.testing.manifests import merge, put_rank, rank_manifest, tensor_entry

JOB = "job"


async def _step(repo: Repository, step: int, b_seed: str) -> None:
    a, a_chunks = tensor_entry("a", "float32", [4, 1024], seed="same")  # 4 chunks, shared
    b, b_chunks = tensor_entry("b", "float32", [2, 1024], seed=b_seed)  # 2 chunks
    manifest = rank_manifest(JOB, step, 0, 1, [a, b])
    await put_rank(repo, manifest, merge(a_chunks, b_chunks))
    assert (await repo.commit(JOB, step)).state == "committed"


async def test_census_bytes_per_job_unique_per_step_and_dedup(any_store: Store) -> None:
    repo = Repository(any_store)
    await _step(repo, 1, "b1")
    await _step(repo, 2, "b2")
    await repo.put_chunk(chunk_id(b"garbage"), b"garbage")
    space = await census(repo)
    (job,) = space.jobs
    assert job.job == JOB
    assert [(s.step, s.logical_bytes, s.unique_bytes) for s in job.steps] == [
        (1, 6 * 4096, 2 * 4096), (2, 6 * 4096, 2 * 4096)]
    assert job.stored_bytes == 8 * 4096 and job.dedup_ratio == 1.5
    assert space.chunk_bytes == 8 * 4096 + len(b"garbage") and space.chunks == 9
    assert (space.free_bytes is not None) == isinstance(any_store, LocalStore)


async def test_a_nearly_full_store_refuses_new_snapshots(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s", fsync=False)
    repo = Repository(store)
    repo.space_guard = SpaceGuard(store, min_free_bytes=1 << 62, warn_free_bytes=1 << 62)
    with pytest.raises(StoreFull) as info:
        await repo.missing_chunks([chunk_id(b"x")], claimer="r0")
    assert info.value.code == "store_full" and http_status("store_full") == 507
    repo.space_guard = SpaceGuard(store, min_free_bytes=0, warn_free_bytes=0)
    assert (await repo.missing_chunks([chunk_id(b"x")], claimer="r0")).missing
    memory = Repository(MemoryStore())  # no disk to measure: never refused
    memory.space_guard = SpaceGuard(memory.store, min_free_bytes=1 << 62, warn_free_bytes=0)
    assert (await memory.missing_chunks([chunk_id(b"x")], claimer="r0")).missing


async def test_stale_temporaries_go_at_start_and_live_ones_stay(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s", fsync=False)
    await store.put_if_absent("chunks/ab/keep", b"object")
    old = tmp_path / "s" / "chunks" / "ab" / ".tmp-0123456789abcdef0123456789abcdef"
    live = tmp_path / "s" / ".tmp-fedcba9876543210fedcba9876543210"
    old.write_bytes(b"half an upload")
    live.write_bytes(b"an upload in flight")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    removed = await remove_stale_temporaries(store, max_upload_s=600)
    assert removed == (1, len(b"half an upload"))
    assert not old.exists() and live.exists()
    assert await store.get("chunks/ab/keep") == b"object"
