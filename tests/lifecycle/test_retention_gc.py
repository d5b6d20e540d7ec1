"""Retention, tags and garbage collection over memory, local and S3 stores."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.errors import CheckpointNotFound, GcInProgress, InvalidName, InvalidPolicy
from ckptd.format import chunk_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.gc import collect_garbage
from ckptd.lifecycle.retention import RetentionPolicy, forget, parse_retention
from ckptd.lifecycle.tags import read_tags, remove_tag, set_tag
from ckptd.repository import Repository
from ckptd.store.base import Store
from ckptd.testing.manifests import demo_step, put_rank

JOB = "job"


async def commit_step(repo: Repository, step: int, *, meta: dict[str, object] | None = None
                      ) -> None:
    for manifest, chunks in demo_step(JOB, step, 2):
        await put_rank(repo, manifest, chunks)
    assert (await repo.commit(JOB, step, meta=meta)).state == "committed"


async def test_forget_then_collect(any_store: Store) -> None:
    repo = Repository(any_store)
    for step in range(1, 7):
        await commit_step(repo, step, meta={"tag": "eval-best"} if step == 2 else None)
    manifest, chunks = demo_step(JOB, 7, 2)[0]
    await put_rank(repo, manifest, chunks)  # step 7 stays pending: its chunks stay
    await repo.put_chunk(chunk_id(b"orphan"), b"orphan")
    assert await read_tags(any_store, JOB) == {"eval-best": 2}

    policy = RetentionPolicy(keep_last=2)
    dry = await forget(repo, JOB, policy, dry_run=True)
    assert dry.forgotten == [1, 3, 4]
    why = {d.step: d.reasons for d in dry.steps}
    assert why[2] == ("tagged eval-best",) and "latest" in why[6]
    assert (await repo.read_commit(JOB, 1)).step == 1  # the dry run changed nothing

    plan = await forget(repo, JOB, policy)
    assert plan.forgotten == [1, 3, 4]
    for step in (1, 3, 4):
        with pytest.raises(CheckpointNotFound):
            await repo.read_commit(JOB, step)

    would = await collect_garbage(any_store, grace=0.0, dry_run=True)
    done = await collect_garbage(any_store, grace=0.0)
    assert done.deleted == would.deleted  # the dry run lists exactly what goes
    assert chunk_id(b"orphan") in done.deleted
    assert done.bytes_freed == would.bytes_freed > 0
    assert done.chunks_kept == done.chunks_total - done.chunks_deleted
    for cid in chunks:  # the pending step's chunks
        assert await any_store.exists(chunk_key(cid))
    for step in (2, 5, 6):
        assert (await repo.verify(JOB, step)).ok
    again = await collect_garbage(any_store, grace=0.0)
    assert again.chunks_deleted == 0 and again.generation == done.generation + 1


async def test_rollback_target_latest_and_untagged(any_store: Store) -> None:
    repo = Repository(any_store)
    for step in range(1, 5):
        await commit_step(repo, step)
    await repo.set_rollback(JOB, 1)
    await set_tag(any_store, JOB, "keep-me", 2)
    assert await remove_tag(any_store, JOB, "keep-me")
    assert not await remove_tag(any_store, JOB, "keep-me")
    plan = await forget(repo, JOB, RetentionPolicy(keep_last=1))
    assert plan.forgotten == [2, 3]
    # (Steps 2 - 4 were committed before the rollback: a restore of latest gets 1 too.)
    assert {d.step: d.reasons for d in plan.steps}[1] == (
        "restore of latest (a rollback went back to it)", "rollback target")
    with pytest.raises(InvalidName):
        await set_tag(any_store, JOB, "../bad", 4)


async def test_abandoned_pending_steps_and_no_rule_keeps_all(any_store: Store) -> None:
    repo = Repository(any_store)
    await commit_step(repo, 1)
    manifest, chunks = demo_step(JOB, 2, 2)[0]
    await put_rank(repo, manifest, chunks)
    keep_all = await forget(repo, JOB, RetentionPolicy(abandon_pending_after=3600.0))
    assert keep_all.forgotten == []  # young pending step, and no keep rule: nothing goes
    import time

    later = await forget(repo, JOB, RetentionPolicy(abandon_pending_after=3600.0),
                         now=time.time() + 7200)
    assert later.forgotten == [2]
    assert await repo.step_numbers(JOB) == [1]
    done = await collect_garbage(any_store, grace=0.0)
    assert set(chunks) - {c for c in chunks if await any_store.exists(chunk_key(c))} and (
        done.chunks_deleted > 0)
    assert (await repo.verify(JOB, 1)).ok


async def test_one_collection_at_a_time_and_a_dead_one_is_taken_over(any_store: Store) -> None:
    from ckptd.lifecycle.documents import GC_STATE_KEY, GcState

    dead = GcState(generation=4, phase="sweeping", holder="x", started_at=0.0,
                   expires_at=9e18)
    await any_store.put_if_absent(GC_STATE_KEY, dead.canonical())
    with pytest.raises(GcInProgress):
        await collect_garbage(any_store, grace=0.0)
    expired = dead.model_copy(update={"expires_at": 1.0})
    assert await any_store.compare_and_swap(GC_STATE_KEY, dead.canonical(), expired.canonical())
    report = await collect_garbage(any_store, grace=0.0)
    assert report.generation == 5


def test_retention_file() -> None:
    config = parse_retention(
        '[retention]\nkeep_last = 5\nkeep_within = "2h"\nabandon_pending_after = "1d"\n'
        '[retention.jobs.big]\nkeep_last = 2\nkeep_every = 100\n'
    )
    assert config.default == RetentionPolicy(keep_last=5, keep_within=7200.0,
                                             abandon_pending_after=86400.0)
    assert config.for_job("big").keep_last == 2 and config.for_job("big").keep_within == 7200.0
    assert config.for_job("other") is config.default
    for bad in ("[retention]\nkeep_last = 0\n", "[retention]\nkeep_lots = 1\n",
                '[retention]\nkeep_within = "soon"\n', "[retention\n"):
        with pytest.raises(InvalidPolicy):
            parse_retention(bad)


@pytest.mark.parametrize("line, said", [
    ("keep_last = true", "retention.keep_last must be an integer >= 1, not true"),
    ('keep_every = "7"', 'retention.keep_every must be an integer >= 1, not "7"'),
    ('keep_within = "soon"', 'retention.keep_within: "soon" is not a duration'),
])
def test_a_bad_retention_value_is_said_as_the_file_spells_it(line: str, said: str) -> None:
    """(Found by a probe: ``keep_last = true`` was refused as "not True", Python's
    word for a value the file spells ``true``.)"""
    with pytest.raises(InvalidPolicy) as refused:
        parse_retention(f"[retention]\n{line}\n")
    assert said in refused.value.message, refused.value.message


async def test_the_mark_parses_manifests_off_the_event_loop_with_the_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server's background collection reads every manifest: parsed on the event
    loop (a 100,000-tensor one takes about a second), or with collections scanning
    its objects, /healthz would stall meanwhile."""
    import gc
    import threading

    from ckptd.format import RankManifest
    from ckptd.store.memory import MemoryStore

    repo = Repository(MemoryStore())
    await commit_step(repo, 1)
    seen: list[tuple[str, bool]] = []
    parse = RankManifest.parse

    def watched(data: bytes) -> RankManifest:
        seen.append((threading.current_thread().name, gc.isenabled()))
        return parse(data)

    monkeypatch.setattr(RankManifest, "parse", staticmethod(watched))
    was = gc.isenabled()
    report = await collect_garbage(repo.store, grace=0.0)
    assert report.manifests_read == len(seen) == 2
    loop_thread = threading.current_thread().name
    assert all(name != loop_thread and not enabled for name, enabled in seen), seen
    assert gc.isenabled() == was


async def test_forgotten_steps_leave_no_directory_or_lock_file(tmp_path: Path) -> None:
    # A week of saves with retention: each removed step left an empty directory and
    # its removal claim's lock file in a local store (the soak counted 890 of each
    # after an hour, with 4 steps kept).
    from ckptd.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    repo = Repository(store)
    for step in range(1, 9):
        await commit_step(repo, step)
    plan = await forget(repo, JOB, RetentionPolicy(keep_last=2))
    assert plan.forgotten == [1, 2, 3, 4, 5, 6]
    steps = tmp_path / "store" / "jobs" / JOB / "steps"
    assert sorted(p.name for p in steps.iterdir()) == ["7", "8"]
    locks = tmp_path / "store" / ".locks"
    assert not [p.name for p in locks.iterdir() if p.name.endswith("removing.json")]
    for step in (7, 8):
        assert (await repo.verify(JOB, step)).ok
    await commit_step(repo, 9)  # a step saved after the removals writes as before
    assert (await repo.verify(JOB, 9)).ok
