"""Retention removes a step's documents while a commit of that step lands (a late
rank's, or a retry): one of the two gives way, and no committed step ever lacks
a manifest (``removal_key``, FORMAT.md Lifecycle). Also: a commit's tag."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import CkptdError, NotCommitted, StoreError
from ckptd.format import removal_key
from ckptd.lifecycle.retention import ForgetPlan, RetentionPolicy, forget
from ckptd.lifecycle.tags import read_tags
from ckptd.repository import Repository
from ckptd.store.local import LocalStore
from ckptd.testing.faults import FaultyStore
from ckptd.testing.manifests import rank_manifest, tensor_entry


async def _pending_step(repo: Repository, job: str, step: int, world: int = 2) -> None:
    """Every rank's manifest is in; the commit that should have followed failed."""
    for r in range(world):
        e, chunks = tensor_entry("w", "float32", [16], seed="w")
        for cid, data in chunks.items():
            await repo.put_chunk(cid, data)
        await repo.put_manifest(rank_manifest(job, step, r, world, [e]))


async def _whole(repo: Repository, job: str, step: int, world: int = 2) -> bool:
    """The step is committed with every manifest readable."""
    if await repo.try_read_commit(job, step) is None:
        return False
    for r in range(world):
        await repo.read_manifest(job, step, r)
    return True


def test_a_commit_that_lands_while_a_pending_step_is_abandoned_gives_way(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        await _pending_step(repo, "j", 5)
        real = store.delete
        commits: list[asyncio.Task[object]] = []

        async def delete(key: str) -> None:
            if not commits:
                # Another rank commits the step right now, as retention begins to
                # remove it (after its check for a record).
                commits.append(asyncio.ensure_future(repo.commit("j", 5)))
            for _ in range(200):  # until that commit wrote its record
                if await store.exists("jobs/j/steps/5/commit.json") or commits[0].done():
                    break
                await asyncio.sleep(0.02)
            await real(key)

        store.delete = delete  # type: ignore[method-assign]
        plan = await forget(repo, "j", RetentionPolicy(abandon_pending_after=60.0),
                            now=time.time() + 3600)
        store.delete = real  # type: ignore[method-assign]
        assert [d.decision for d in plan.steps] == ["abandon"]
        with pytest.raises(NotCommitted):
            await commits[0]
        assert await repo.try_read_commit("j", 5) is None  # taken back
        assert await repo.latest_ref_step("j") is None
        assert not [k async for k in store.list_prefix("jobs/j/steps/5/")]

    asyncio.run(scenario())


def test_a_step_that_committed_before_the_claim_is_kept(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        await _pending_step(repo, "j", 5)
        real = store.put_if_absent

        async def put_if_absent(key: str, data: bytes | memoryview) -> bool:
            if key == removal_key("j", 5):
                await repo.commit("j", 5)  # lands just before retention claims
            return await real(key, data)

        store.put_if_absent = put_if_absent  # type: ignore[method-assign]
        await forget(repo, "j", RetentionPolicy(abandon_pending_after=60.0),
                     now=time.time() + 3600)
        store.put_if_absent = real  # type: ignore[method-assign]
        assert await _whole(repo, "j", 5)
        assert await repo.latest_ref_step("j") == 5
        assert not await store.exists(removal_key("j", 5))

    asyncio.run(scenario())


def test_a_commit_record_written_after_a_step_was_removed_is_taken_back(
    tmp_path: Path,
) -> None:
    """The commit read every manifest, then retention removed the whole step (claim
    included) before the commit wrote its record: the record must not stand."""

    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        await _pending_step(repo, "j", 5)
        real = store.put_if_absent

        async def put_if_absent(key: str, data: bytes | memoryview) -> bool:
            if key.endswith("/commit.json"):
                await forget(repo, "j", RetentionPolicy(abandon_pending_after=60.0),
                             now=time.time() + 3600)
            return await real(key, data)

        store.put_if_absent = put_if_absent  # type: ignore[method-assign]
        with pytest.raises(NotCommitted):
            await repo.commit("j", 5)
        store.put_if_absent = real  # type: ignore[method-assign]
        assert await repo.try_read_commit("j", 5) is None
        assert await repo.latest_ref_step("j") is None

    asyncio.run(scenario())


def test_a_tag_that_cannot_be_written_leaves_the_step_committed(tmp_path: Path) -> None:
    with Checkpointer(f"file://{tmp_path}/store", "j", shm_dir=tmp_path / "shm",
                      serve_peers=False) as ckpt:
        store = ckpt._transport.repository.store  # type: ignore[attr-defined]
        real = store.compare_and_swap
        fail = [True]

        async def cas(key: str, expected: bytes | None, data: bytes) -> bool:
            if key.endswith("refs/tags") and fail[0]:
                raise StoreError("tags write failed (injected)")
            return bool(await real(key, expected, data))

        store.compare_and_swap = cas
        result = ckpt.save(7, {"w": torch.arange(10.0)}, tag="best").wait(30)
        assert result.state == "committed"
        repo = Repository(LocalStore(str(tmp_path / "store")))
        assert asyncio.run(repo.latest_ref_step("j")) == 7
        fail[0] = False  # a retry of the commit sets the tag
        asyncio.run(repo.commit("j", 7, meta={"tag": "best"}))
        assert asyncio.run(read_tags(repo.store, "j")).get("best") == 7


def test_a_tag_asked_for_by_any_rank_tags_the_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    state = {"w": torch.arange(8.0)}
    with Checkpointer(url, "j", rank=0, world_size=2, shm_dir=tmp_path / "s0",
                      serve_peers=False) as c0, \
            Checkpointer(url, "j", rank=1, world_size=2, shm_dir=tmp_path / "s1",
                         serve_peers=False) as c1:
        assert c0.save(4, state, tag="best").wait(30).state == "pending"
        assert c1.save(4, state).wait(30).state == "committed"  # rank 1 commits, untagged
    repo = Repository(LocalStore(str(tmp_path / "store")))
    assert asyncio.run(read_tags(repo.store, "j")).get("best") == 4
    record = asyncio.run(repo.read_commit("j", 4))
    assert record.meta.get("tag") == "best"


def test_errors_of_a_removal_race_are_typed() -> None:
    assert issubclass(NotCommitted, CkptdError)


def test_two_retention_passes_remove_a_step_once(tmp_path: Path) -> None:
    """Every replica runs retention: a second pass that finds the step claimed leaves
    it to the first, and never drops the first pass's claim while a commit waits on
    it (found by review)."""
    import contextvars

    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="")

    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        await _pending_step(repo, "j", 5)
        real = store.delete
        paused, resume = asyncio.Event(), asyncio.Event()

        async def delete(key: str) -> None:
            if who.get() == "P1" and not resume.is_set():  # every delete of P1 waits
                paused.set()
                await resume.wait()
            await real(key)

        store.delete = delete  # type: ignore[method-assign]
        policy = RetentionPolicy(abandon_pending_after=60.0)
        now = time.time() + 3600

        async def run(name: str) -> object:
            who.set(name)
            return await forget(repo, "j", policy, now=now)

        first = asyncio.ensure_future(run("P1"))
        await asyncio.wait_for(paused.wait(), 30)  # P1 claimed and began removing
        await run("P2")  # finds the claim: leaves the step to P1
        assert await store.exists(removal_key("j", 5))
        assert await store.exists("jobs/j/steps/5/ranks/1.json")
        commit = asyncio.ensure_future(repo.commit("j", 5))
        for _ in range(300):  # until the late commit wrote its record
            if await store.exists("jobs/j/steps/5/commit.json") or commit.done():
                break
            await asyncio.sleep(0.01)
        resume.set()
        await first
        with pytest.raises(NotCommitted):
            await commit
        store.delete = real  # type: ignore[method-assign]
        assert await repo.try_read_commit("j", 5) is None
        assert await repo.latest_ref_step("j") is None
        assert not [k async for k in store.list_prefix("jobs/j/steps/5/")]

    asyncio.run(scenario())


def test_a_dead_pass_claim_is_taken_over_once_stale(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        await _pending_step(repo, "j", 5)
        policy = RetentionPolicy(abandon_pending_after=60.0)
        key = removal_key("j", 5)
        fresh = b'{"format":"ckptd.removal","since":%d,"token":"x","version":1}'
        await store.put_if_absent(key, fresh % int(time.time()))
        await forget(repo, "j", policy, now=time.time() + 3600)  # a live pass holds it
        assert await store.exists("jobs/j/steps/5/ranks/0.json")
        await store.compare_and_swap(key, fresh % int(time.time()), fresh % 0)  # it died
        await forget(repo, "j", policy, now=time.time() + 3600)
        assert not [k async for k in store.list_prefix("jobs/j/steps/5/")]

    asyncio.run(scenario())


async def _two_committed(repo: Repository) -> None:
    """Steps 5 and 6 committed, untagged: retention with keep_last=1 forgets 5."""
    for step in (5, 6):
        await _pending_step(repo, "j", step)
        assert (await repo.commit("j", step)).state == "committed"


@pytest.mark.parametrize("how", ["commit retry", "ckptd tag"])
def test_a_tag_set_on_a_step_retention_removed_meanwhile_is_taken_back(
    tmp_path: Path, how: str
) -> None:
    """A commit retry (or ``ckptd tag``) read step 5's record (no removal claim yet);
    retention then removed the whole step before the tag was written: the answer is
    not_committed and no tag names the removed step."""

    async def scenario() -> None:
        store = FaultyStore(LocalStore(str(tmp_path / "store")))
        repo = Repository(store)
        await _two_committed(repo)
        real = store.get
        removed: list[ForgetPlan] = []
        started = []

        async def get(key: str) -> bytes:
            if key.endswith("refs/tags") and not started:  # the retry is about to tag
                started.append(True)
                removed.append(await forget(repo, "j", RetentionPolicy(keep_last=1)))
            return await real(key)

        store.get = get  # type: ignore[method-assign]
        with pytest.raises(NotCommitted):
            if how == "commit retry":
                await repo.commit("j", 5, meta={"tag": "best"})
            else:
                await repo.tag("j", "best", 5)
        store.get = real  # type: ignore[method-assign]
        assert removed[0].forgotten == [5]
        assert await repo.try_read_commit("j", 5) is None
        assert await read_tags(store, "j") == {}  # no tag names the removed step
        assert store.count("compare_and_swap", "refs/tags") == 2  # set, then taken back

    asyncio.run(scenario())


def test_a_step_tagged_after_retention_planned_to_forget_it_is_kept(tmp_path: Path) -> None:
    """The retry tagged step 5 after retention's plan read the tags, before its
    claim: retention reads the tags again once it holds the claim, and keeps it."""

    async def scenario() -> None:
        store = FaultyStore(LocalStore(str(tmp_path / "store")))
        repo = Repository(store)
        await _two_committed(repo)
        real = store.put_if_absent
        answers: list[str] = []

        async def put_if_absent(key: str, data: bytes | memoryview) -> bool:
            if key == removal_key("j", 5) and not answers:
                answers.append((await repo.commit("j", 5, meta={"tag": "best"})).state)
            return await real(key, data)

        store.put_if_absent = put_if_absent  # type: ignore[method-assign]
        plan = await forget(repo, "j", RetentionPolicy(keep_last=1))
        store.put_if_absent = real  # type: ignore[method-assign]
        assert answers == ["committed"]
        assert plan.forgotten == []
        assert await _whole(repo, "j", 5)
        assert await read_tags(store, "j") == {"best": 5}
        assert not await store.exists(removal_key("j", 5))

    asyncio.run(scenario())


def test_a_step_read_while_retention_removes_it_is_not_called_uncommitted(
    tmp_path: Path,
) -> None:
    """Retention deletes a step's commit record first, then its manifests under its
    removal claim: a read in between finds manifests and no record, which is not a
    step that "never committed" (a 409 telling the caller to wait for the commit)
    but one that is going (404, saying so). Without the claim it is still pending."""
    from ckptd.errors import CheckpointNotFound
    from ckptd.format import commit_key

    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        await _pending_step(repo, "j", 5)
        with pytest.raises(NotCommitted):
            await repo.read_commit("j", 5)
        await repo.commit("j", 5)
        assert await _whole(repo, "j", 5)
        # Retention, halfway: its claim made, the record deleted, manifests left.
        await store.put_if_absent(removal_key("j", 5), b'{"format": "ckptd.removal"}')
        await store.delete(commit_key("j", 5))
        with pytest.raises(CheckpointNotFound, match="being removed by retention"):
            await repo.read_commit("j", 5)

    asyncio.run(scenario())


def test_replicas_retention_of_one_job_says_each_forgotten_step_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every replica applies retention: two passes at once each logged every step
    their plans forgot (the same steps twice), and one that read a step the other
    removed meanwhile warned that retention failed (an operator's probe)."""
    from ckptd.lifecycle.retention import RetentionConfig
    from ckptd.lifecycle.service import LifecycleService, LifecycleSettings
    from ckptd.testing.manifests import demo_step, put_rank

    async def scenario() -> None:
        store = LocalStore(str(tmp_path / "store"))
        repo = Repository(store)
        for step in range(1, 7):
            for manifest, chunks in demo_step("j", step, 2):
                await put_rank(repo, manifest, chunks)
            assert (await repo.commit("j", step)).state == "committed"
        settings = LifecycleSettings(retention=RetentionConfig(RetentionPolicy(keep_last=1)),
                                     census_interval=0.0, census_process=False)
        replicas = [LifecycleService(Repository(LocalStore(str(tmp_path / "store"))), settings)
                    for _ in range(2)]
        await asyncio.gather(*(r.apply_retention() for r in replicas))
        assert [i.step for i in await repo.list_steps("j")] == [6]

    with caplog.at_level(logging.INFO, logger="ckptd.lifecycle.service"):
        asyncio.run(scenario())
    said = [int(s) for r in caplog.records if "forgot steps" in r.getMessage()
            for s in re.findall(r"\d+", r.getMessage().partition("steps")[2])]
    assert sorted(said) == [1, 2, 3, 4, 5], caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
