"""The census (issue 20 item 6): space accounting updated by what changes it, equal
to a recount from every manifest; its own manifest reader; space summaries in the
store (kept, reused, replaced when stale or damaged, left alone when newer, gone
with their step); one pass at a time; a worker process that may die."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.format import RankManifest, commit_key, manifest_key
from ckptd.hashing import chunk_id, chunk_spans
from ckptd.lifecycle.book_views import SUMMARY_MIN_BYTES
from ckptd.lifecycle.capacity import StoreSpace
from ckptd.lifecycle.census import Census, census, space_key
from ckptd.lifecycle.gc import collect_garbage
from ckptd.lifecycle.retention import RetentionPolicy, forget
from ckptd.lifecycle.space_book import canonical, manifest_chunks
from ckptd.repository import Repository
from ckptd.store import LocalStore, MemoryStore
from ckptd.store.base import Store
from ckptd.testing.faults import FaultyStore
from ckptd.testing.manifests import (
    demo_step,
    many_tensor_manifests,
    merge,
    put_rank,
    rank_manifest,
    tensor_entry,
)

# -- a recount from every manifest, as the census used to do it ---------------------------


async def recount(repo: Repository) -> dict[str, Any]:
    """Per job: stored bytes, logical bytes, [(step, logical, unique)]; and the bytes
    of every distinct chunk the committed steps name."""
    named: dict[tuple[str, int], dict[str, int]] = {}
    logical: dict[tuple[str, int], int] = {}
    for job in await repo.list_jobs():
        for step in await repo.step_numbers(job):
            record = await repo.try_read_commit(job, step)
            if record is None:
                continue
            sizes: dict[str, int] = {}
            for rank in range(record.world_size):
                m = await repo.read_manifest(job, step, rank)
                for e in m.entries:
                    for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, m.chunk_size),
                                           strict=True):
                        sizes[cid] = b - a
            named[(job, step)] = sizes
            logical[(job, step)] = record.report.logical_bytes
    refs = Counter(c for sizes in named.values() for c in sizes)
    every = {c: s for sizes in named.values() for c, s in sizes.items()}
    jobs: dict[str, Any] = {}
    for (job, step), sizes in sorted(named.items()):
        j = jobs.setdefault(job, {"stored": {}, "logical": 0, "steps": []})
        j["stored"].update(sizes)
        j["logical"] += logical[(job, step)]
        j["steps"].append((step, logical[(job, step)],
                           sum(s for c, s in sizes.items() if refs[c] == 1)))
    return {"jobs": {k: (sum(v["stored"].values()), v["logical"], v["steps"])
                     for k, v in jobs.items()},
            "referenced": sum(every.values())}


def seen(space: StoreSpace) -> dict[str, Any]:
    return {"jobs": {j.job: (j.stored_bytes, j.logical_bytes,
                             [(s.step, s.logical_bytes, s.unique_bytes) for s in j.steps])
                     for j in space.jobs},
            "referenced": space.referenced_bytes}


async def commit_demo(repo: Repository, job: str, step: int, *, seed: str = "",
                      world: int = 2) -> None:
    for manifest, chunks in demo_step(job, step, world, seed=seed):
        await put_rank(repo, manifest, chunks)
    assert (await repo.commit(job, step)).state == "committed"


async def commit_shared(repo: Repository, job: str, step: int, own: str) -> None:
    """One rank: a tensor every job and step shares, and one of its own."""
    a, a_chunks = tensor_entry("shared", "float32", [4, 1024], seed="everyone")
    b, b_chunks = tensor_entry("own", "float32", [2, 1024], seed=own)
    await put_rank(repo, rank_manifest(job, step, 0, 1, [a, b]), merge(a_chunks, b_chunks))
    assert (await repo.commit(job, step)).state == "committed"


def hold_view(counter: Census) -> tuple[asyncio.Event, asyncio.Event]:
    """Holds the census's next view refresh: the first event is set once it asks the
    worker for the view, which it gets once the second is set."""
    in_view, go_on = asyncio.Event(), asyncio.Event()
    call = counter._worker.call

    async def held_view(method: str, *args: Any) -> tuple[Any, float]:
        if method == "view" and not go_on.is_set():
            in_view.set()
            await go_on.wait()
        return await call(method, *args)

    counter._worker.call = held_view  # type: ignore[method-assign]
    return in_view, go_on


# -- what it counts ---------------------------------------------------------------------


async def test_hooks_keep_the_census_equal_to_a_recount(any_store: Store) -> None:
    """Commits (the repository's hook), retention (forgotten steps) and collection
    (chunk totals) change the view without a full pass, and it always equals a
    recount from every manifest."""
    repo = Repository(any_store)
    counter = Census(repo, interval=0, fresh_after=1e9, process=False)
    repo.on_committed = counter.note_commit
    task = counter.start()
    try:
        await counter.current(wait=10)  # the first full pass
        passes = counter._full_at
        await commit_demo(repo, "a", 1)
        await commit_demo(repo, "a", 2)
        await commit_shared(repo, "b", 1, "b1")
        await commit_shared(repo, "c", 1, "c1")  # "shared" is in two jobs: unique to none
        space = await counter.current(wait=10)
        assert space.complete and seen(space) == await recount(repo)
        assert {j.job for j in space.jobs} == {"a", "b", "c"}
        # a: 6 chunks a step; b: 4 shared + 2 own; c: 2 own
        assert space.chunks == 12 + 6 + 2 and space.chunk_bytes == space.referenced_bytes
        plan = await forget(repo, "a", RetentionPolicy(keep_last=1))
        assert plan.forgotten == [1]
        counter.note_forgotten("a", plan.forgotten)
        space = await counter.current(wait=10)
        assert seen(space) == await recount(repo)
        assert counter._full_at == passes  # no full pass: the hooks said it all
        # a/1's chunks, stored since chunks/ was listed, stay in the store until a
        # collection: still counted, as named by no committed step (they were not).
        assert space.chunks == 20 and space.unreferenced_chunks == 6, space
        assert space.unreferenced_bytes == space.chunk_bytes - space.referenced_bytes > 0
        report = await collect_garbage(any_store, grace=0, lease=30)
        assert report.chunks_deleted == 6 and report.bytes_freed == space.unreferenced_bytes
        counter.note_collection(report.chunks_total - report.chunks_deleted,
                                report.bytes_total - report.bytes_freed, 0.0)
        space = await counter.current(wait=10)
        assert (space.chunks, space.chunk_bytes) == (14, report.bytes_total - report.bytes_freed)
        assert space.unreferenced_chunks == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()


async def test_a_commit_during_its_view_refresh_is_counted_before_it_says_idle() -> None:
    """A step committed while the task refreshes its view with nothing else to do:
    a request waiting for the view gets it with that step counted, not a view the
    task called idle as it finished the refresh (CI saw ``complete=False``)."""
    repo = Repository(MemoryStore())
    counter = Census(repo, interval=0, fresh_after=1e9, process=False)
    repo.on_committed = counter.note_commit
    task = counter.start()
    try:
        await counter.current(wait=10)
        in_view, go_on = hold_view(counter)
        counter._view_dirty = True
        counter._poke()  # nothing to count: it only refreshes its view
        async with asyncio.timeout(10):
            await in_view.wait()
        await commit_demo(repo, "a", 1)
        waiting = asyncio.create_task(counter.current(wait=10))
        await asyncio.sleep(0.05)
        go_on.set()
        space = await waiting
        assert space.uncounted_steps == 0 and space.complete
        assert seen(space) == await recount(repo)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()


async def test_the_view_is_not_complete_while_its_refresh_is_on_its_way() -> None:
    """While the worker computes the view after a step was counted, the view as it
    stands (a GET /v1/space that waits briefly) lacks that step: it must not say it
    is complete (a full run's census said complete without a job: its refresh on a
    store of a million entries takes a while)."""
    repo = Repository(MemoryStore())
    counter = Census(repo, interval=0, fresh_after=1e9, process=False)
    repo.on_committed = counter.note_commit
    task = counter.start()
    try:
        assert (await counter.current(wait=10)).complete
        in_view, go_on = hold_view(counter)
        await commit_demo(repo, "a", 1)
        async with asyncio.timeout(10):
            await in_view.wait()
        space = counter.space
        assert space is not None
        assert not space.complete or [j.job for j in space.jobs] == ["a"], space
        go_on.set()
        space = await counter.current(wait=10)
        assert space.complete and seen(space) == await recount(repo)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()


async def test_a_cancel_is_not_lost_when_work_arrives_with_it(tmp_path: Path) -> None:
    """A server stopping cancels the census task. When that cancel arrives in the
    same turn of the loop as a poke (a commit just before shutdown), the task still
    ends: it once took the poke and waited on, up to the next listing (600 s)."""
    counter = Census(Repository(LocalStore(tmp_path / "s", fsync=False)),
                     interval=0, process=False)
    task = counter.start()
    try:
        await counter.current(wait=10)  # the first pass and listing: then it waits
        await asyncio.sleep(0.05)
        counter.note_commit("j", 1)  # its wait is over ...
        await asyncio.sleep(0)
        task.cancel()  # ... but it has not run yet
        done, _ = await asyncio.wait({task}, timeout=5)
        assert task in done and task.cancelled()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()


async def test_a_full_pass_finds_what_others_committed_and_forgot(tmp_path: Path) -> None:
    """Another replica's commits and forgets reach this census at its next full pass;
    a chunk stored since the last listing is counted without one."""
    store = LocalStore(tmp_path / "s", fsync=False)
    mine, theirs = Repository(store), Repository(LocalStore(tmp_path / "s", fsync=False))
    counter = Census(mine, process=False)
    await commit_demo(theirs, "j", 1)
    assert seen(await counter.count_all()) == await recount(mine)
    await commit_demo(theirs, "j", 2)
    await commit_shared(theirs, "k", 1, "k")
    await forget(theirs, "j", RetentionPolicy(keep_last=1))
    await counter._full_pass()
    await counter._refresh_view()
    space = counter.space
    assert space is not None and seen(space) == await recount(mine)
    # listed when j/1 was all there was; j/2 and k/1 brought 12 chunks since
    assert space.chunks == 6 + 12 and space.uncounted_steps == 0
    await counter.close()


async def test_a_listing_drops_orphans_another_collection_deleted(tmp_path: Path) -> None:
    """Chunks a forgotten step named stay counted until a listing begun after they
    were orphaned; one that a collection elsewhere deleted then goes from the count."""
    repo = Repository(LocalStore(tmp_path / "s", fsync=False))
    counter = Census(repo, process=False)
    await counter.count_all()  # chunks/ listed: empty
    await commit_demo(repo, "j", 1)
    await commit_demo(repo, "j", 2)
    await counter._full_pass()
    await forget(repo, "j", RetentionPolicy(keep_last=1))
    await counter._full_pass()
    await counter._refresh_view()
    assert counter.space is not None and counter.space.chunks == 12
    await collect_garbage(repo.store, grace=0, lease=30)  # another server's: not told
    space = await counter.count_all()  # (a listing)
    assert (space.chunks, space.unreferenced_chunks) == (6, 0), space
    await counter.close()


async def test_a_step_forgotten_before_it_was_counted_is_listed_again(tmp_path: Path
                                                                     ) -> None:
    """A step committed and forgotten before the census counted it: its chunks are
    in the store and in no count, so chunks/ is listed again (not complete until
    then), not left out until the next listing ten minutes on."""
    repo = Repository(LocalStore(tmp_path / "s", fsync=False))
    counter = Census(repo, interval=0, fresh_after=1e9, process=False)
    task = counter.start()
    try:
        assert (await counter.current(wait=10)).complete  # chunks/ listed: empty
        await commit_demo(repo, "j", 1)
        await commit_demo(repo, "j", 2)
        await forget(repo, "j", RetentionPolicy(keep_last=1))
        counter.note_commit("j", 1)  # (told after the forget: never counted)
        counter.note_commit("j", 2)
        counter.note_forgotten("j", [1])
        space = await counter.current(wait=10)
        assert space.complete and space.chunks == 12, space
        assert space.unreferenced_chunks == 6 and not space.listing_again, space
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()


async def test_a_step_forgotten_while_it_is_counted_is_not_called_damaged(tmp_path: Path
                                                                         ) -> None:
    """Retention forgets a step between the census's read of its record and of its
    manifests: the step is gone, not damaged (``ckptd space`` said it was, exit 1)."""
    repo = Repository(LocalStore(tmp_path / "s", fsync=False))
    counter = Census(repo, process=False)
    await counter.count_all()
    await commit_demo(repo, "j", 1)
    await commit_demo(repo, "j", 2)
    call = counter._worker.call

    async def forget_once_begun(method: str, *args: Any) -> tuple[Any, float]:
        answer = await call(method, *args)
        if method == "begin" and args[:2] == ("j", 1):
            assert (await forget(repo, "j", RetentionPolicy(keep_last=1))).forgotten == [1]
        return answer

    counter._worker.call = forget_once_begun  # type: ignore[method-assign]
    counter.note_commit("j", 1)
    counter.note_commit("j", 2)
    await counter._count_queued()
    await counter._refresh_view()
    space = counter._make_space()
    assert space.damaged == [] and [s.step for s in space.jobs[0].steps] == [2], space
    # (step 1's chunks were not all seen: chunks/ is listed again, then counted)
    assert space.listing_again and not space.complete, space
    space = await counter.count_all()
    assert space.chunks == 12 and space.unreferenced_chunks == 6, space
    assert space.complete and not space.listing_again, space
    await counter.close()


async def test_damaged_documents_are_named_and_the_rest_counted(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s", fsync=False)
    repo = Repository(store)
    for step in (1, 2, 3):
        await commit_demo(repo, "j", step)
    root = tmp_path / "s" / "jobs" / "j" / "steps"
    (root / "1" / "commit.json").write_bytes(b'{"format":"ckptd.commit",')
    record = json.loads((root / "2" / "commit.json").read_bytes())
    (root / "2" / "commit.json").write_bytes(canonical({**record, "version": 9}))
    man = root / "3" / "ranks" / "1.json"
    man.write_bytes(man.read_bytes()[:-1] + b" ")
    space = await census(repo)
    assert [s.step for s in space.jobs[0].steps] == [3]  # rank 0 of it still counts
    said = "\n".join(space.damaged)
    assert "damaged document jobs/j/steps/1/commit.json" in said
    assert "jobs/j/steps/2/commit.json" in said and "newer ckptd" in said
    assert "damaged document jobs/j/steps/3/ranks/1.json" in said
    assert not space.complete or space.uncounted_steps == 0


# -- its own reading of manifests ---------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                max_size=12) | st.sampled_from(['"chunks":["', '\\', '"},{"chunks":[', "]"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(names, st.integers(0, 3 * 4096)), max_size=6, unique_by=lambda t: t[0]),
       st.sampled_from([4096, 8192]))
def test_the_manifest_reader_reads_what_the_parser_reads(
        tensors: list[tuple[str, int]], chunk_size: int) -> None:
    entries, chunks = [], {}
    for i, (name, nbytes) in enumerate(tensors):
        entry, data = tensor_entry(name, "uint8", [nbytes], seed=str(i % 3),
                                   chunk_size=chunk_size)
        entries.append(entry)
        chunks.update(data)
    manifest = rank_manifest("j", 1, 0, 1, entries, chunk_size=chunk_size,
                             meta={'x"chunks":[': ["0" * 64]})
    expected = {int(cid[:16], 16): len(chunks[cid]) for e in entries for cid in e.chunks}
    for data in (manifest.canonical(), json.dumps(json.loads(manifest.canonical()),
                                                  indent=1).encode()):
        ids, sizes = manifest_chunks(data)
        assert dict(zip(ids.tolist(), sizes.tolist(), strict=True)) == expected
    assert RankManifest.parse(manifest.canonical()).chunk_ids() == set(chunks)


def test_the_books_canonical_json_is_the_formats() -> None:
    from ckptd.format import canonical_json

    doc = {"b": [1, 2.5, "é\n"], "a": {"z": None, "y": True}, "format": "x"}
    assert canonical(doc) == canonical_json(doc)


# -- space summaries ----------------------------------------------------------------------

BIG = 20_000  # tensors: a manifest of about 5 MiB


async def _big_step(repo: Repository, job: str, step: int) -> None:
    (manifest,), data = many_tensor_manifests(job, step, 1, BIG)
    await put_rank(repo, manifest, {chunk_id(data): data})
    assert len(manifest.canonical()) >= SUMMARY_MIN_BYTES
    assert (await repo.commit(job, step)).state == "committed"


async def test_a_large_steps_summary_is_kept_and_read_instead_of_its_manifests() -> None:
    store = FaultyStore(MemoryStore())
    repo = Repository(store)
    await _big_step(repo, "moe", 1)
    await commit_demo(repo, "small", 1)
    first = await Census(repo, process=False).count_all()
    doc = json.loads(await store.get(space_key("moe", 1)))
    assert doc["format"] == "ckptd.step_space" and doc["chunks"] == 1
    assert doc["commit"] == (await repo.read_commit("moe", 1)).digest()
    assert not await store.exists(space_key("small", 1))  # small: counted again, cheaply
    before = store.count("get", match="moe/steps/1/ranks/")
    again = await Census(repo, process=False).count_all()  # a restarted server
    assert store.count("get", match="moe/steps/1/ranks/") == before
    assert seen(again) == seen(first) == await recount(repo)


async def test_stale_or_damaged_summaries_are_replaced_and_newer_ones_left_alone() -> None:
    store = MemoryStore()
    repo = Repository(store)
    await _big_step(repo, "moe", 1)
    await Census(repo, process=False).count_all()
    key = space_key("moe", 1)
    good = await store.get(key)
    doc = json.loads(good)
    for bad in (b"{", canonical({**doc, "commit": "0" * 64}),
                canonical({**doc, "chunk_bytes": doc["chunk_bytes"] + 1})):
        assert await store.compare_and_swap(key, await store.get(key), bad)
        space = await Census(repo, process=False).count_all()
        assert seen(space) == await recount(repo)
        assert await store.get(key) == good
    newer = canonical({**doc, "version": 2, "chunks": 7})
    assert await store.compare_and_swap(key, good, newer)
    space = await Census(repo, process=False).count_all()
    assert seen(space) == await recount(repo) and await store.get(key) == newer


async def test_two_replicas_counting_one_step_write_one_summary(tmp_path: Path) -> None:
    stores = [LocalStore(tmp_path / "s", fsync=False) for _ in range(2)]
    await _big_step(Repository(stores[0]), "moe", 1)
    counters = [Census(Repository(s), process=False) for s in stores]
    views = await asyncio.gather(*(c.count_all() for c in counters))
    assert seen(views[0]) == seen(views[1])
    files = list((tmp_path / "s" / "space").rglob("*"))
    assert [f.name for f in files if f.is_file()] == ["1.json"]


async def test_a_forgotten_steps_summary_goes_at_the_next_full_pass() -> None:
    store = MemoryStore()
    repo = Repository(store)
    await _big_step(repo, "moe", 1)
    await _big_step(repo, "moe", 2)
    counter = Census(repo, process=False)
    await counter.count_all()
    assert await store.exists(space_key("moe", 1))
    await forget(repo, "moe", RetentionPolicy(keep_last=1))  # another server's retention
    await counter._full_pass()
    assert not await store.exists(space_key("moe", 1))
    assert await store.exists(space_key("moe", 2))
    assert [k async for k in store.list_prefix("space/")] == [space_key("moe", 2)]


# -- one pass at a time, a worker that may die --------------------------------------------


async def test_requests_and_hooks_never_run_two_passes_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Repository(MemoryStore())
    for step in range(1, 4):
        await commit_demo(repo, "j", step)
    counter = Census(repo, interval=0.05, fresh_after=0, process=False)
    running: Counter[str] = Counter()
    most: Counter[str] = Counter()

    def watched(name: str, work: Any) -> Any:
        async def run(self: Census, *args: Any) -> Any:
            running[name] += 1
            most[name] = max(most[name], running[name])
            try:
                await asyncio.sleep(0.01)
                return await work(self, *args)
            finally:
                running[name] -= 1

        return run

    monkeypatch.setattr(Census, "_full_pass", watched("pass", Census._full_pass))
    monkeypatch.setattr(Census, "_count", watched("count", Census._count))
    task = counter.start()
    try:
        for _ in range(5):
            counter.note_commit("j", 3)
            await asyncio.gather(counter.count_all(),  # (the CLI's way: waits its turn)
                                 *(counter.current(wait=0.2) for _ in range(8)))
        space = await counter.current(wait=5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()
    assert most == {"pass": 1, "count": 1} and len(space.jobs[0].steps) == 3


@pytest.mark.slow
async def test_the_worker_process_counts_and_one_killed_is_replaced(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s", fsync=False)
    repo = Repository(store)
    await commit_demo(repo, "j", 1)
    await _big_step(repo, "moe", 1)
    counter = Census(repo, interval=0.2, fresh_after=0, cpu_share=1.0, process=True)
    task = counter.start()
    try:
        for _ in range(200):
            if (space := await counter.current(wait=1)).complete:
                break
        assert seen(space) == await recount(repo)
        pid = counter._worker.pid
        assert pid is not None and Path(f"/proc/{pid}").exists()
        os.kill(pid, signal.SIGKILL)
        await commit_demo(repo, "j", 2)
        counter.note_commit("j", 2)
        for _ in range(200):
            space = await counter.current(wait=1)
            if space.complete and counter._worker.starts == 2 and len(space.jobs) == 2 and len(
                    space.jobs[0].steps) == 2:
                break
        assert counter._worker.starts == 2 and counter._worker.pid != pid
        assert space.complete and seen(space) == await recount(repo)
        second = counter._worker.pid
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await counter.close()
    assert second is not None and not Path(f"/proc/{second}").exists()  # reaped at close


def test_commit_key_layout_is_what_the_census_lists() -> None:
    assert commit_key("j", 7) == "jobs/j/steps/7/commit.json"
    assert manifest_key("j", 7, 1) == "jobs/j/steps/7/ranks/1.json"
    assert space_key("j", 7) == "space/j/7.json"


async def test_the_worker_gets_its_share_of_a_core_and_no_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After each call the census waits so that the worker's CPU time is at most
    ``cpu_share`` of the time: 0.2 s of CPU at a quarter of a core, 0.6 s more."""
    counter = Census(Repository(MemoryStore()), cpu_share=0.25, process=False)

    async def busy(method: str, *args: Any) -> tuple[Any, float]:
        return None, 0.2

    monkeypatch.setattr(counter._worker, "call", busy)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    await counter._call("view")
    assert slept == [pytest.approx(0.6)]
