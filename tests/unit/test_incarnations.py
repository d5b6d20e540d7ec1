"""Launches of one job (FORMAT.md "Launches"): a step commits only with manifests
that one launch wrote; a restarted launch's manifest replaces an earlier one's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import pytest

from ckptd.errors import AlreadyCommitted, Conflict
from ckptd.format import RankManifest, commit_key, manifest_key
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.store.base import Store
from ckptd.testing.manifests import Chunks, put_rank, rank_manifest, tensor_entry

JOB = "job"


def sharded_rank(step: int, rank: int, seed: str, launch: str | None,
                 world: int = 2) -> tuple[RankManifest, Chunks]:
    """One rank's FSDP-like manifest: only its shard of ``w`` (no replica to compare,
    so bytes of two launches validate together unless the launch tells them apart)."""
    entry, chunks = tensor_entry("w", "float32", [4, 64], placement="sharded",
                                 global_shape=[4 * world, 64], offsets=[4 * rank, 0],
                                 seed=f"{seed}/{step}/{rank}")
    meta: dict[str, Any] = {} if launch is None else {"incarnation": launch}
    return rank_manifest(JOB, step, rank, world, [entry], meta=meta), chunks


async def test_a_later_launch_replaces_a_pending_manifest_of_an_earlier_one(
        repo: Repository, store: Store) -> None:
    old = sharded_rank(10, 0, "attempt0", "run:0")
    await put_rank(repo, *old)
    new = sharded_rank(10, 0, "attempt1", "run:1")
    assert await put_rank(repo, *new) == new[0].digest()  # not a Conflict: replaced
    assert await store.get(manifest_key(JOB, 10, 0)) == new[0].canonical()
    # Within one launch manifests stay immutable: other bytes are still a Conflict.
    with pytest.raises(Conflict):
        await put_rank(repo, *sharded_rank(10, 0, "again", "run:1"))
    # And once the step committed, no launch changes it.
    await put_rank(repo, *sharded_rank(10, 1, "attempt1", "run:1"))
    assert (await repo.commit(JOB, 10)).state == "committed"
    with pytest.raises(AlreadyCommitted):
        await put_rank(repo, *sharded_rank(10, 0, "attempt2", "run:2"))


async def test_manifests_without_a_launch_keep_the_old_rule(repo: Repository) -> None:
    await put_rank(repo, *sharded_rank(3, 0, "a", None))
    with pytest.raises(Conflict):
        await put_rank(repo, *sharded_rank(3, 0, "b", None))


async def test_a_step_never_commits_manifests_of_two_launches(repo: Repository, store: Store
                                                              ) -> None:
    """The restart of the review: rank 0's manifest of the dead launch is there, rank
    1's of the new launch completes the step. Before launches, this committed rank
    0's old shard beside rank 1's new one."""
    await put_rank(repo, *sharded_rank(10, 0, "attempt0", "run:0"))
    new = [sharded_rank(10, r, "attempt1", "run:1") for r in range(2)]
    await put_rank(repo, *new[1])
    status = await repo.commit(JOB, 10, meta={"incarnation": "run:1"})
    assert status.state == "pending" and status.missing_ranks == [0]
    # A commit that names no launch is just as pending (the step's launch: most ranks,
    # ties to the lowest rank's).
    status = await repo.commit(JOB, 10)
    assert status.state == "pending" and status.missing_ranks == [1]
    assert not await store.exists(commit_key(JOB, 10))
    await put_rank(repo, *new[0])  # rank 0 of the new launch gets there
    status = await repo.commit(JOB, 10, meta={"incarnation": "run:1"})
    assert status.state == "committed" and status.record is not None
    assert [r.hash for r in status.record.manifests] == [m.digest() for m, _ in new]


async def test_a_manifest_without_a_launch_is_not_paired_with_one_that_has_one(
        repo: Repository) -> None:
    """An older client's manifest (no launch named) and a newer one's: not known to be
    of one launch, so replaced, never committed together."""
    await put_rank(repo, *sharded_rank(4, 0, "old", None))
    await put_rank(repo, *sharded_rank(4, 1, "new", "run:1"))
    assert (await repo.commit(JOB, 4)).state == "pending"
    await put_rank(repo, *sharded_rank(4, 0, "new", "run:1"))
    assert (await repo.commit(JOB, 4)).state == "committed"


# -- a restart racing the commit of the dead launch's step -------------------------------

Hook = Callable[[str], Awaitable[None]]


class RacingStore(MemoryStore):
    """A memory store that runs ``hooks[op]`` once, before the first ``op`` call on a
    key it accepts: another writer's move at the worst moment."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: dict[str, tuple[Callable[[str], bool], Hook]] = {}

    async def _hook(self, op: str, key: str) -> None:
        armed = self.hooks.get(op)
        if armed is not None and armed[0](key):
            del self.hooks[op]
            await armed[1](key)

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        await self._hook("exists_many", keys[0] if keys else "")
        return await super().exists_many(keys)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        await self._hook("put_if_absent", key)
        return await super().put_if_absent(key, data)

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        await self._hook("compare_and_swap", key)
        return await super().compare_and_swap(key, expected, new)


async def dead_launch_step(repo: Repository) -> list[tuple[RankManifest, Chunks]]:
    """Launch run:0 put every rank's manifest of step 10; its commit is what races."""
    old = [sharded_rank(10, r, "attempt0", "run:0") for r in range(2)]
    for part in old:
        await put_rank(repo, *part)
    return old


async def test_a_manifest_replaced_while_the_commit_validates_is_not_committed() -> None:
    store = RacingStore()
    repo = Repository(store)
    await dead_launch_step(repo)
    new = [sharded_rank(10, r, "attempt1", "run:1") for r in range(2)]

    async def relaunched(_: str) -> None:  # after validation, before the record
        await put_rank(repo, *new[0])

    store.hooks["exists_many"] = (lambda key: key.startswith("chunks/"), relaunched)
    status = await repo.commit(JOB, 10)
    assert not store.hooks  # the replacement did happen inside the commit
    assert status.state == "pending" and not await store.exists(commit_key(JOB, 10))
    await put_rank(repo, *new[1])
    status = await repo.commit(JOB, 10)
    assert status.record is not None
    assert [r.hash for r in status.record.manifests] == [m.digest() for m, _ in new]


async def test_a_manifest_replaced_just_before_the_record_is_put_back() -> None:
    """The replacing put found no record yet; the commit, once its record is in,
    puts the manifest it validated back: the record's bytes are what is stored."""
    store = RacingStore()
    repo = Repository(store)
    old = await dead_launch_step(repo)

    async def relaunched(_: str) -> None:
        await put_rank(repo, *sharded_rank(10, 0, "attempt1", "run:1"))

    store.hooks["put_if_absent"] = (lambda key: key == commit_key(JOB, 10), relaunched)
    status = await repo.commit(JOB, 10)
    assert status.record is not None and not store.hooks
    assert [r.hash for r in status.record.manifests] == [m.digest() for m, _ in old]
    assert await store.get(manifest_key(JOB, 10, 0)) == old[0][0].canonical()
    assert (await repo.verify(JOB, 10)).ok


async def test_a_replacement_that_lands_after_the_record_is_taken_back() -> None:
    """The replacing put looked for a record before the commit wrote it and replaced
    after: it finds the record, puts the committed manifest back, and is refused."""
    store = RacingStore()
    repo = Repository(store)
    old = await dead_launch_step(repo)

    async def old_launch_commits(_: str) -> None:
        assert (await repo.commit(JOB, 10)).state == "committed"

    store.hooks["compare_and_swap"] = (lambda key: key == manifest_key(JOB, 10, 0),
                                       old_launch_commits)
    with pytest.raises(AlreadyCommitted):
        await put_rank(repo, *sharded_rank(10, 0, "attempt1", "run:1"))
    assert await store.get(manifest_key(JOB, 10, 0)) == old[0][0].canonical()
    assert (await repo.verify(JOB, 10)).ok


async def test_a_launch_that_came_back_smaller_commits_without_the_dead_launchs_ranks(
        repo: Repository, store: Store) -> None:
    """Rank 1 of a two-rank launch put its manifest of step 10 and the job came back
    with one rank: rank 1's manifest counts as absent for the new launch's commit
    (before launches: world_size_mismatch, a step that could never commit)."""
    await put_rank(repo, *sharded_rank(10, 1, "attempt0", "run:0"))
    alone = sharded_rank(10, 0, "attempt1", "run:1", world=1)
    await put_rank(repo, *alone)
    status = await repo.commit(JOB, 10, meta={"incarnation": "run:1"})
    assert status.state == "committed" and status.record is not None
    assert [r.hash for r in status.record.manifests] == [alone[0].digest()]
    assert (await repo.verify(JOB, 10)).ok


class FlakyGetStore(RacingStore):
    """A ``RacingStore`` whose next read of ``fail_get`` fails (an S3 503)."""

    fail_get: str | None = None

    async def get(self, key: str) -> bytes:
        if key == self.fail_get:
            self.fail_get = None
            from ckptd.errors import StoreError

            raise StoreError("transient 503 on GET", key=key)
        return await super().get(key)


async def test_a_replacing_put_that_cannot_read_the_record_after_its_swap_puts_back() -> None:
    """The dead launch commits between the new launch's look for a record and its
    swap, and the look after the swap fails: the replaced (committed) manifest is
    put back, not left replaced under a record that names it."""
    from ckptd.errors import StoreError

    store = FlakyGetStore()
    repo = Repository(store)
    old = await dead_launch_step(repo)

    async def old_launch_commits(_: str) -> None:
        assert (await repo.commit(JOB, 10)).state == "committed"
        store.fail_get = commit_key(JOB, 10)

    store.hooks["compare_and_swap"] = (lambda key: key == manifest_key(JOB, 10, 0),
                                       old_launch_commits)
    with pytest.raises(StoreError):
        await put_rank(repo, *sharded_rank(10, 0, "attempt1", "run:1"))
    assert await store.get(manifest_key(JOB, 10, 0)) == old[0][0].canonical()
    assert (await repo.verify(JOB, 10)).ok
