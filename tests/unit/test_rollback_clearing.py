"""The repository ends a rollback: a step committed past the marker, in the
marker's own timeline, clears it (whoever set it, and whether it still runs)."""

from __future__ import annotations

import pytest

from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.testing.manifests import demo_step, put_rank, replace

JOB = "job"


@pytest.fixture
def repo() -> Repository:
    return Repository(MemoryStore(), clock=lambda: 1700000000.0)


async def commit(repo: Repository, step: int, epoch: int = 0) -> bool:
    """Commits ``step`` (2 ranks) saved in timeline ``epoch``; whether it cleared."""
    for manifest, chunks in demo_step(JOB, step, 2):
        if epoch:
            manifest = replace(manifest, meta={**manifest.meta, "epoch": epoch})
        await put_rank(repo, manifest, chunks)
    status = await repo.commit(JOB, step)
    assert status.state == "committed"
    return status.rollback_cleared


async def test_a_commit_past_the_marker_in_its_timeline_clears_it(repo: Repository) -> None:
    assert not await commit(repo, 1)
    assert not await commit(repo, 3)
    await repo.set_rollback(JOB, 3)
    assert not await commit(repo, 2, epoch=1)  # not past the marker: it stays
    marker, epoch = await repo.rollback_state(JOB)
    assert marker is not None and (marker.step, epoch) == (3, 1)
    assert await commit(repo, 4, epoch=1)
    assert await repo.rollback_state(JOB) == (None, 1)
    assert not await commit(repo, 5, epoch=1)  # nothing left to clear


async def test_a_newer_rollback_is_not_cleared_by_a_commit_of_the_one_before(
    repo: Repository,
) -> None:
    await commit(repo, 1)
    await repo.set_rollback(JOB, 1)
    await repo.set_rollback(JOB, 1)  # by hand, again: timeline 2
    # A commit of timeline 1 cannot happen now (its manifests are refused); ask as
    # a commit of it that landed in the moment before the second rollback would.
    assert not await repo.end_rollback_passed(JOB, 2, 1)
    marker, epoch = await repo.rollback_state(JOB)
    assert marker is not None and (marker.step, epoch) == (1, 2)
    assert await repo.end_rollback_passed(JOB, 2, 2)


async def test_a_marker_whose_clearing_cannot_look_again_is_put_back() -> None:
    """The clearing deleted the marker and then cannot read the timeline (a store
    error): a rollback begun meanwhile would be lost, so the marker is put back."""
    from ckptd.errors import StoreError
    from ckptd.testing.faults import FaultyStore

    store = FaultyStore(MemoryStore())
    repo = Repository(store, clock=lambda: 1700000000.0)
    await commit(repo, 1)
    await repo.set_rollback(JOB, 1)
    store.fail_at("get", nth=2, match="refs/timeline")  # the look after the delete
    with pytest.raises(StoreError):
        await repo.end_rollback_passed(JOB, 2, 1)
    marker, epoch = await repo.rollback_state(JOB)
    assert marker is not None and (marker.step, epoch) == (1, 1)


async def test_a_timeline_whose_step_retention_removed_verifies(repo: Repository) -> None:
    """The timeline document keeps naming the step its rollback went back to after
    the rollback ended; retention may then remove that step. verify said 'timeline
    of job names step 3, which has no commit record' of a sound job."""
    from ckptd.lifecycle.retention import RetentionPolicy, forget

    async def saved(step: int, epoch: int) -> None:  # (the meta a rank commits with)
        for manifest, chunks in demo_step(JOB, step, 2):
            await put_rank(repo, replace(manifest, meta={**manifest.meta, "epoch": epoch}),
                           chunks)
        assert (await repo.commit(JOB, step, meta={"epoch": epoch})).state == "committed"

    for step in (1, 3, 5):
        await saved(step, 0)
    await repo.set_rollback(JOB, 3)
    for step in (4, 6, 7):  # past the marker: the rollback ended
        await saved(step, 1)
    assert await repo.rollback_state(JOB) == (None, 1)
    plan = await forget(repo, JOB, RetentionPolicy(keep_last=2))
    assert plan.forgotten == [1, 3, 4, 5]
    timeline = await repo.timeline(JOB)
    assert timeline is not None and timeline.step == 3
    report = await repo.verify(JOB)
    assert report.bad_refs == [] and report.ok, report


async def test_the_steps_a_rollback_left_behind_are_not_called_damaged(
    repo: Repository,
) -> None:
    """Found by a probe: after an operator's rollback from step 3 to step 2, every
    read of latest warned that step 3 was 'marked damaged by scrub' (naming a marker
    that was not there), a restore_fallback event went out per restore, and forget
    called step 2 the 'newest undamaged'. The steps above a rollback are left behind,
    not damaged: latest is step 2, with no word."""
    from ckptd.lifecycle.documents import damage_key
    from ckptd.lifecycle.retention import RetentionPolicy, plan_forget

    for step in (1, 2, 3):
        await commit(repo, step)
    await repo.set_rollback(JOB, 2)
    found = await repo.restorable_step(JOB)
    assert (found.step, found.problems) == (2, [])
    plan = await plan_forget(repo, JOB, RetentionPolicy(keep_last=1))
    why = {d.step: d.reasons for d in plan.steps}
    assert "restore of latest (a rollback went back to it)" in why[2], why
    # Scrub's marker on step 3 is damage, and said so.
    await repo.store.put_if_absent(damage_key(JOB, 3), b"{}")
    found = await repo.restorable_step(JOB)
    assert found.step == 2 and found.problems == [
        f"step 3 of {JOB} is marked damaged by scrub ({damage_key(JOB, 3)})"]
