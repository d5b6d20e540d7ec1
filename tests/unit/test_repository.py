"""The commit protocol over a store: what becomes visible, when, and what is refused."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from ckptd.errors import (
    AlreadyCommitted,
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkNotFound,
    Conflict,
    InvalidDocument,
    InvalidName,
    InvalidRequest,
    ManifestHashMismatch,
    ManifestNotFound,
    MissingChunks,
    NotCommitted,
    NotFound,
    ReplicaMismatch,
    StoreCorrupt,
    Superseded,
    TooLarge,
    WorldSizeMismatch,
)
from ckptd.format import (
    CommitRecord,
    RankManifest,
    Ref,
    Timeline,
    chunk_key,
    commit_key,
    latest_key,
    manifest_key,
    timeline_key,
)
from ckptd.hashing import chunk_id, document_hash
from ckptd.knobs import MAX_CHUNK_SIZE
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.store.base import Store
from ckptd.testing.manifests import (
    Chunks,
    demo_step,
    put_rank,
    rank_manifest,
    replace,
    tensor_entry,
)

JOB = "job"


async def save_step(repo: Repository, step: int, world: int = 2, *, job: str = JOB,
                    ranks: list[int] | None = None, seed: str = "") -> list[RankManifest]:
    parts = demo_step(job, step, world, seed=seed)
    for rank in ranks if ranks is not None else range(world):
        await put_rank(repo, *parts[rank])
    return [m for m, _ in parts]


async def commit_all(repo: Repository, step: int, world: int = 2, job: str = JOB) -> None:
    await save_step(repo, step, world, job=job)
    status = await repo.commit(job, step)
    assert status.state == "committed"


# -- chunks --------------------------------------------------------------------------------


async def test_put_chunk_checks_the_hash_and_stores_nothing_when_wrong(repo: Repository) -> None:
    data = b"some tensor bytes"
    cid = chunk_id(data)
    wrong = chunk_id(b"other bytes")
    with pytest.raises(ChunkHashMismatch) as info:
        await repo.put_chunk(wrong, data)
    assert info.value.detail["actual"] == cid
    assert not await repo.has_chunk(wrong)
    assert not await repo.has_chunk(cid)
    assert [k async for k in repo.store.list_prefix("")] == []
    assert await repo.put_chunk(cid, data) is True
    assert await repo.put_chunk(cid, data) is False  # dedup
    assert await repo.get_chunk(cid) == data


async def test_a_refused_upload_releases_its_claim(repo: Repository) -> None:
    # Otherwise the other replicas would wait out the whole lease for nothing.
    data = b"claimed bytes"
    cid = chunk_id(data)
    assert (await repo.missing_chunks([cid], claimer="a")).missing == [cid]
    assert (await repo.missing_chunks([cid], claimer="b")).in_flight == [cid]
    with pytest.raises(ChunkHashMismatch):
        await repo.put_chunk(cid, b"not the claimed bytes")
    assert (await repo.missing_chunks([cid], claimer="b")).missing == [cid]


async def test_stray_names_under_jobs_do_not_break_the_listing(
    repo: Repository, store: Store
) -> None:
    await save_step(repo, 1, world=1)
    await commit_all(repo, 1, world=1)
    await store.put_if_absent("jobs/-not a job-/steps/1/commit.json", b"{}")
    assert await repo.list_jobs() == [JOB]


async def test_put_chunk_trusts_a_streamed_digest_only_if_it_matches(repo: Repository) -> None:
    data = b"streamed"
    cid = chunk_id(data)
    with pytest.raises(ChunkHashMismatch):
        await repo.put_chunk(cid, data, digest="0" * 64)
    assert not await repo.has_chunk(cid)
    assert await repo.put_chunk(cid, data, digest=cid)


async def test_put_chunk_refuses_bad_ids_and_huge_bodies(repo: Repository) -> None:
    with pytest.raises(InvalidName):
        await repo.put_chunk("../../etc/passwd", b"x")
    with pytest.raises(TooLarge):
        await repo.put_chunk("0" * 64, memoryview(bytearray(MAX_CHUNK_SIZE + 1)))


async def test_get_chunk_detects_a_flipped_bit(repo: Repository, store: Store) -> None:
    data = bytes(range(256)) * 32
    cid = chunk_id(data)
    await repo.put_chunk(cid, data)
    flipped = bytearray(data)
    flipped[1000] ^= 0x01
    await store.delete(chunk_key(cid))  # replace behind the repository's back
    await store.put_if_absent(chunk_key(cid), bytes(flipped))
    with pytest.raises(ChunkHashMismatch) as info:
        await repo.get_chunk(cid)
    assert info.value.detail["id"] == cid
    assert await repo.get_chunk(cid, verify=False) == bytes(flipped)
    with pytest.raises(ChunkNotFound):
        await repo.get_chunk(chunk_id(b"never stored"))


async def test_missing_chunks_and_claims(repo: Repository) -> None:
    a, b, c = (chunk_id(x) for x in (b"a", b"b", b"c"))
    await repo.put_chunk(a, b"a")
    got = await repo.missing_chunks([a, b, c, b])
    assert got.missing == [b, c] and got.in_flight == []
    first = await repo.missing_chunks([a, b, c], claimer="rank0")
    assert first.missing == [b, c]
    second = await repo.missing_chunks([b, c], claimer="rank1")
    assert second.missing == [] and second.in_flight == [b, c]
    again = await repo.missing_chunks([b], claimer="rank0")  # the holder may ask again
    assert again.missing == [b]
    await repo.put_chunk(b, b"b")  # sending it releases the claim
    third = await repo.missing_chunks([b, c], claimer="rank1")
    assert third.missing == [] and third.in_flight == [c]
    expired = await repo.missing_chunks([c], claimer="rank2", lease=0.0)
    assert expired.in_flight == [c]
    late = await repo.missing_chunks([c], claimer="rank3")
    assert late.in_flight == [c]  # rank0's lease still holds
    with pytest.raises(InvalidName):
        await repo.missing_chunks(["nope"])


class _SlowExists(MemoryStore):
    """A memory store whose existence checks wait for a gate: the window in which
    another replica can finish a chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.checking = asyncio.Event()
        self.gate = asyncio.Event()

    async def exists_many(self, keys: list[str]) -> list[bool]:
        answer = await super().exists_many(keys)
        self.checking.set()
        await self.gate.wait()
        return answer


async def test_a_chunk_stored_while_another_caller_checks_is_not_sent_again() -> None:
    """rank1 checks the store, rank0 finishes the chunk and lets go of its lease,
    then rank1 looks at the leases: the chunk must count as stored, not as free."""
    store = _SlowExists()
    repo = Repository(store)
    cid = chunk_id(b"x")
    store.gate.set()
    assert (await repo.missing_chunks([cid], claimer="rank0")).missing == [cid]
    store.gate.clear()
    store.checking.clear()
    late = asyncio.create_task(repo.missing_chunks([cid], claimer="rank1"))
    await store.checking.wait()  # rank1 saw the chunk absent
    await repo.put_chunk(cid, b"x")  # rank0 sends it; its lease ends
    store.gate.set()
    answer = await late
    assert answer.missing == [] and answer.in_flight == []
    assert repo._claims._stored == {}  # nothing remembered once no check is open


async def test_a_failed_upload_frees_the_chunk_for_the_next_caller() -> None:
    repo = Repository(MemoryStore())
    cid = chunk_id(b"y")
    assert (await repo.missing_chunks([cid], claimer="rank0")).missing == [cid]
    with pytest.raises(ChunkHashMismatch):
        await repo.put_chunk(cid, b"not y")
    assert (await repo.missing_chunks([cid], claimer="rank1")).missing == [cid]


async def test_missing_chunks_batch_limit(repo: Repository, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.setenv("CKPTD_MISSING_BATCH", "2")
    with pytest.raises(TooLarge):
        await repo.missing_chunks(["0" * 64] * 3)


# -- manifests -----------------------------------------------------------------------------


async def test_a_manifest_naming_a_missing_chunk_is_refused(repo: Repository, store: Store
                                                           ) -> None:
    (m, chunks), _ = demo_step(JOB, 1, 2)
    absent = sorted(chunks)[0]
    for cid in sorted(chunks)[1:]:
        await repo.put_chunk(cid, chunks[cid])
    with pytest.raises(MissingChunks) as info:
        await repo.put_manifest(m)
    assert info.value.code == "missing_chunks"
    assert info.value.detail["ids"] == [absent]
    assert not await store.exists(manifest_key(JOB, 1, 0))
    await repo.put_chunk(absent, chunks[absent])
    assert await repo.put_manifest(m) == m.digest()


async def test_manifests_are_immutable(repo: Repository, store: Store) -> None:
    parts = demo_step(JOB, 1, 2)
    m, chunks = parts[0]
    digest = await put_rank(repo, m, chunks)
    assert digest == m.digest()
    assert await store.get(manifest_key(JOB, 1, 0)) == m.canonical()
    assert await repo.put_manifest(m) == digest  # the same again: fine
    assert await repo.put_manifest(m.canonical()) == digest  # as bytes too
    different = replace(m, meta={"note": "changed"})
    with pytest.raises(Conflict) as info:
        await repo.put_manifest(different)
    assert info.value.code == "conflict"
    assert await store.get(manifest_key(JOB, 1, 0)) == m.canonical()


async def test_a_committed_step_is_closed(repo: Repository, store: Store) -> None:
    manifests = await save_step(repo, 1)
    await repo.commit(JOB, 1)
    assert await repo.put_manifest(manifests[1]) == manifests[1].digest()  # a retry: fine
    with pytest.raises(AlreadyCommitted):
        await repo.put_manifest(replace(manifests[1], meta={"x": 1}))
    # a rank that is not in the committed world cannot appear in the step either
    (m2, chunks), = [demo_step(JOB, 1, 3)[2]]
    for cid, data in chunks.items():
        await repo.put_chunk(cid, data)
    with pytest.raises(AlreadyCommitted):
        await repo.put_manifest(m2)
    assert not await store.exists(manifest_key(JOB, 1, 2))


async def test_put_manifest_refuses_bad_bytes(repo: Repository, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    with pytest.raises(InvalidDocument):
        await repo.put_manifest(b"{not json")
    monkeypatch.setenv("CKPTD_MAX_MANIFEST_BYTES", "10")
    with pytest.raises(TooLarge):
        await repo.put_manifest(b"{" + b" " * 20 + b"}")


# -- commit --------------------------------------------------------------------------------


async def test_commit_is_pending_until_every_rank_is_in(repo: Repository, store: Store) -> None:
    await save_step(repo, 1, world=3, ranks=[0, 2])
    status = await repo.commit(JOB, 1)
    assert status.state == "pending"
    assert status.missing_ranks == [1] and status.world_size == 3 and status.record is None
    assert not await store.exists(commit_key(JOB, 1))
    assert await repo.latest(JOB) is None
    with pytest.raises(NotCommitted):
        await repo.read_commit(JOB, 1)
    with pytest.raises(NotCommitted):
        await repo.read_manifest(JOB, 1, 0)
    await save_step(repo, 1, world=3, ranks=[1])
    status = await repo.commit(JOB, 1, meta={"reason": "periodic"})
    assert status.state == "committed" and status.missing_ranks == []
    record = status.record
    assert record is not None
    assert record.meta == {"reason": "periodic"}
    assert record.committed_at == 1700000000.0
    assert await repo.latest(JOB) == 1
    stored = await store.get(commit_key(JOB, 1))
    assert stored == record.canonical()
    ref = Ref.parse(await store.get(latest_key(JOB)))
    assert ref.step == 1 and ref.commit == document_hash(stored)


async def test_commit_record_names_every_manifest_by_its_hash(repo: Repository, store: Store
                                                             ) -> None:
    manifests = await save_step(repo, 5, world=4)
    record = (await repo.commit(JOB, 5)).record
    assert record is not None
    assert [m.rank for m in record.manifests] == [0, 1, 2, 3]
    for ref, m in zip(record.manifests, manifests, strict=True):
        raw = await store.get(manifest_key(JOB, 5, m.rank))
        assert ref.hash == document_hash(raw) == m.digest()
        assert ref.size == len(raw)
        assert await repo.read_manifest(JOB, 5, m.rank) == m
    assert record.report.tensors == 2 and record.report.local_entries == 4
    with pytest.raises(ManifestNotFound, match="world size 4"):  # no such manifest: 404
        await repo.read_manifest(JOB, 5, 4)


async def test_commit_is_idempotent_and_concurrent_calls_agree(repo: Repository) -> None:
    await save_step(repo, 1, world=4)
    statuses = await asyncio.gather(*(repo.commit(JOB, 1) for _ in range(8)))
    records = {s.record.canonical() for s in statuses if s.record is not None}
    assert len(records) == 1 and all(s.state == "committed" for s in statuses)
    again = await repo.commit(JOB, 1)
    assert again.record is not None and again.record.canonical() in records


async def test_commit_without_any_manifest(repo: Repository) -> None:
    with pytest.raises(ManifestNotFound):
        await repo.commit(JOB, 9)
    with pytest.raises(CheckpointNotFound):
        await repo.read_commit(JOB, 9)
    with pytest.raises(InvalidName):
        await repo.commit("../x", 1)


async def test_commit_refuses_a_rank_outside_the_world(repo: Repository) -> None:
    # rank 0 says a world of 1, rank 1 says 2: never one checkpoint
    (m0, c0), = [demo_step(JOB, 1, 1)[0]]
    (m1, c1), = [demo_step(JOB, 1, 2)[1]]
    await put_rank(repo, m0, c0)
    await put_rank(repo, m1, c1)
    with pytest.raises(WorldSizeMismatch):
        await repo.commit(JOB, 1)
    assert await repo.latest(JOB) is None


async def test_commit_refuses_disagreeing_ranks(repo: Repository) -> None:
    parts = demo_step(JOB, 1, 2)
    bad_w, bad_chunks = tensor_entry("model.w", "float32", [8, 256], seed="divergent")
    m1 = replace(parts[1][0], entries=[bad_w, *parts[1][0].entries[1:]])
    await put_rank(repo, *parts[0])
    await put_rank(repo, m1, {**parts[1][1], **bad_chunks})
    with pytest.raises(ReplicaMismatch):
        await repo.commit(JOB, 1)
    assert await repo.latest(JOB) is None
    lenient = Repository(repo.store, replica_mismatch="warn")
    status = await lenient.commit(JOB, 1)
    assert status.record is not None and len(status.record.report.warnings) == 1


async def test_commit_refuses_a_step_whose_chunk_vanished(repo: Repository, store: Store) -> None:
    manifests = await save_step(repo, 1)
    victim = manifests[0].entries[0].chunks[0]
    await store.delete(chunk_key(victim))
    with pytest.raises(MissingChunks):
        await repo.commit(JOB, 1)
    assert not await store.exists(commit_key(JOB, 1))


async def test_commit_meta_must_be_json(repo: Repository) -> None:
    await save_step(repo, 1)
    with pytest.raises(InvalidRequest):
        await repo.commit(JOB, 1, meta={"loss": float("nan")})
    with pytest.raises(InvalidRequest):
        await repo.commit(JOB, 1, meta={"obj": object()})
    assert await repo.latest(JOB) is None


# -- latest --------------------------------------------------------------------------------


async def test_latest_only_moves_forward(repo: Repository, store: Store) -> None:
    await commit_all(repo, 5)
    assert await repo.latest(JOB) == 5
    await commit_all(repo, 3)  # a late commit of an older step
    assert await repo.latest(JOB) == 5
    assert (await repo.read_commit(JOB, 3)).step == 3  # committed all the same
    await commit_all(repo, 8)
    assert await repo.latest(JOB) == 8
    await repo.commit(JOB, 5)  # re-committing an old step does not pull latest back
    assert await repo.latest(JOB) == 8


async def test_latest_never_names_an_uncommitted_step(repo: Repository) -> None:
    await commit_all(repo, 1)
    await save_step(repo, 2, ranks=[0])
    assert (await repo.commit(JOB, 2)).state == "pending"
    assert await repo.latest(JOB) == 1
    assert await repo.resolve_step(JOB, None) == 1
    assert await repo.resolve_step(JOB, 2) == 2  # explicit steps are the caller's choice
    with pytest.raises(CheckpointNotFound):
        await repo.resolve_step("other", None)


async def test_latest_is_repaired_by_a_retried_commit(repo: Repository, store: Store) -> None:
    await commit_all(repo, 1)
    await save_step(repo, 2)
    await repo.commit(JOB, 2)
    # as if the writer died after the commit record and before the ref
    one = await repo.read_commit(JOB, 1)
    await store.compare_and_swap(
        latest_key(JOB), await store.get(latest_key(JOB)),
        Ref(step=1, commit=one.digest()).canonical(),
    )
    assert await repo.latest(JOB) == 1
    await repo.commit(JOB, 2)
    assert await repo.latest(JOB) == 2


async def test_jobs_are_separate(repo: Repository) -> None:
    await commit_all(repo, 1, job="a")
    await commit_all(repo, 7, job="b")
    assert await repo.list_jobs() == ["a", "b"]
    assert await repo.latest("a") == 1 and await repo.latest("b") == 7
    assert await repo.latest("c") is None


# -- reads and verification ----------------------------------------------------------------


async def test_list_steps(repo: Repository) -> None:
    await commit_all(repo, 1)
    await commit_all(repo, 2)
    await save_step(repo, 3, world=3, ranks=[1])
    steps = await repo.list_steps(JOB)
    assert [(s.step, s.committed, s.is_latest, s.ranks_present) for s in steps] == [
        (1, True, False, 2), (2, True, True, 2), (3, False, False, 1),
    ]
    assert steps[2].world_size == 3 and steps[2].logical_bytes is None
    assert steps[0].committed_at == 1700000000.0 and steps[0].logical_bytes


async def test_read_manifest_detects_a_manifest_changed_on_disk(repo: Repository, store: Store
                                                               ) -> None:
    manifests = await save_step(repo, 1)
    await repo.commit(JOB, 1)
    key = manifest_key(JOB, 1, 1)
    tampered = replace(manifests[1], meta={"evil": True}).canonical()
    await store.delete(key)
    await store.put_if_absent(key, tampered)
    # Store damage naming the document, not the caller's request (a 4xx).
    with pytest.raises(StoreCorrupt) as caught:
        await repo.read_manifest(JOB, 1, 1)
    assert caught.value.detail["key"] == key
    # the same content, re-encoded with other whitespace: not the committed bytes either
    await store.delete(key)
    await store.put_if_absent(key, json.dumps(json.loads(manifests[1].canonical())).encode())
    with pytest.raises(StoreCorrupt):
        await repo.read_manifest(JOB, 1, 1)
    await store.delete(key)
    with pytest.raises(StoreCorrupt) as caught:
        await repo.read_manifest(JOB, 1, 1)
    assert caught.value.detail["key"] == key
    assert await repo.read_manifest(JOB, 1, 0) == manifests[0]


async def test_a_commit_record_copied_to_another_step_is_refused(repo: Repository, store: Store
                                                                 ) -> None:
    await commit_all(repo, 1)
    await store.put_if_absent(commit_key(JOB, 2), await store.get(commit_key(JOB, 1)))
    # Store damage, not the caller's bad input (issue 10 item 6): a 5xx store_corrupt.
    with pytest.raises(StoreCorrupt):
        await repo.read_commit(JOB, 2)


async def test_verify_reports_bad_and_missing_chunks(repo: Repository, store: Store) -> None:
    manifests = await save_step(repo, 1)
    await repo.commit(JOB, 1)
    report = await repo.verify(JOB, 1)
    all_ids = {c for m in manifests for e in m.entries for c in e.chunks}
    assert report.ok and report.chunks_checked == len(all_ids)
    w_chunks = manifests[0].entries[0].chunks
    bad, gone = w_chunks[0], w_chunks[1]
    good_bytes = await store.get(chunk_key(bad))
    await store.delete(chunk_key(bad))
    await store.put_if_absent(chunk_key(bad), good_bytes[::-1])
    await store.delete(chunk_key(gone))
    seen: list[tuple[int, int]] = []
    report = await repo.verify(JOB, progress=lambda done, total: seen.append((done, total)))
    assert not report.ok
    assert report.bad_chunks == [bad] and report.missing_chunks == [gone]
    assert report.chunks_checked == len(all_ids)
    assert seen[-1] == (len(all_ids), len(all_ids))


async def test_verify_reports_a_manifest_that_no_longer_parses(repo: Repository, store: Store
                                                               ) -> None:
    await save_step(repo, 1)
    await repo.commit(JOB, 1)
    key = manifest_key(JOB, 1, 0)
    await store.delete(key)
    await store.put_if_absent(key, b"\x00garbage")
    report = await repo.verify(JOB, 1)
    assert not report.ok and len(report.bad_manifests) == 1
    assert "rank 0" in report.bad_manifests[0]


async def test_verify_needs_a_committed_step(repo: Repository) -> None:
    with pytest.raises(CheckpointNotFound):
        await repo.verify(JOB)
    await save_step(repo, 1, ranks=[0])
    with pytest.raises(NotCommitted):
        await repo.verify(JOB, 1)


async def test_not_found_errors_are_key_errors(repo: Repository) -> None:
    with pytest.raises(KeyError):
        await repo.read_commit(JOB, 1)
    assert issubclass(ChunkNotFound, NotFound)


async def test_the_store_holds_only_documented_keys(repo: Repository, store: Store) -> None:
    await commit_all(repo, 1)
    keys = sorted([k async for k in store.list_prefix("")])
    for key in keys:
        parts = key.split("/")
        if parts[0] == "chunks":
            assert len(parts) == 3 and parts[2].startswith(parts[1]) and len(parts[1]) == 2
            assert chunk_id(await store.get(key)) == parts[2]
        else:
            assert key in {
                manifest_key(JOB, 1, 0), manifest_key(JOB, 1, 1), commit_key(JOB, 1),
                latest_key(JOB),
            }
    rec = CommitRecord.parse(await store.get(commit_key(JOB, 1)))
    assert rec.world_size == 2


async def test_a_manifest_with_a_scalar_and_nothing_else(repo: Repository) -> None:
    scalar, chunks = tensor_entry("lr", "float64", [])
    empty, _ = tensor_entry("e", "float32", [0])
    m = rank_manifest(JOB, 1, 0, 1, [scalar, empty])
    all_chunks: Chunks = dict(chunks)
    await put_rank(repo, m, all_chunks)
    status = await repo.commit(JOB, 1)
    assert status.record is not None and status.record.report.logical_bytes == 8
    assert (await repo.verify(JOB, 1)).ok


# -- rollback: timelines -------------------------------------------------------------------


def in_timeline(m: RankManifest, epoch: int) -> RankManifest:
    return replace(m, meta={**m.meta, "epoch": epoch})


async def test_a_rollback_starts_a_timeline_that_refuses_older_saves(repo: Repository,
                                                                     store: Store) -> None:
    await commit_all(repo, 1)
    assert await repo.epoch(JOB) == 0
    old = demo_step(JOB, 2, 2, seed="before")
    await put_rank(repo, *old[0])  # rank 0 saved step 2 before the NaN on rank 1
    done = await repo.set_rollback(JOB, 1)
    assert (done.marker.step, done.epoch, done.started) == (1, 1, True)
    assert Timeline.parse(await store.get(timeline_key(JOB))).epoch == 1
    m1, c1 = old[1]
    with pytest.raises(Superseded) as info:  # rank 1 had not heard of the rollback yet
        await put_rank(repo, m1, c1)
    assert info.value.code == "superseded" and info.value.detail["current"] == 1
    with pytest.raises(Conflict):  # a timeline the job has not reached
        await put_rank(repo, in_timeline(m1, 2), c1)
    assert await repo.clear_rollback(JOB)
    assert await repo.epoch(JOB) == 1  # clearing the marker keeps the count


async def test_a_step_never_mixes_manifests_from_both_sides_of_a_rollback(repo: Repository
                                                                          ) -> None:
    await commit_all(repo, 1)
    before = demo_step(JOB, 2, 2, seed="before")
    await put_rank(repo, *before[0])
    await repo.set_rollback(JOB, 1)
    after = [(in_timeline(m, 1), c) for m, c in demo_step(JOB, 2, 2, seed="after")]
    await put_rank(repo, *after[1])
    status = await repo.commit(JOB, 2)
    assert status.state == "pending" and status.missing_ranks == [0]  # the old one is no vote
    digest = await put_rank(repo, *after[0])  # replaces the manifest saved before
    assert digest == after[0][0].digest()
    status = await repo.commit(JOB, 2)
    assert status.state == "committed" and status.record is not None
    assert [r.hash for r in status.record.manifests] == [m.digest() for m, _ in after]
    with pytest.raises(AlreadyCommitted):  # committed: closed to every timeline
        await repo.put_manifest(in_timeline(before[0][0], 1))


async def test_a_rollback_asked_from_an_ended_timeline_is_the_same_rollback(repo: Repository
                                                                            ) -> None:
    await commit_all(repo, 1)
    await commit_all(repo, 2)
    assert (await repo.set_rollback(JOB, 1, from_epoch=0)).epoch == 1
    # Rank 3's NaN came from the same timeline: that rollback is already set.
    done = await repo.set_rollback(JOB, 2, from_epoch=0)
    assert (done.marker.step, done.epoch, done.started) == (1, 1, False)
    # A NaN after everyone rolled back is a new rollback, even to the same step.
    assert (await repo.set_rollback(JOB, 1, from_epoch=1)).epoch == 2
    assert (await repo.set_rollback(JOB, 1)).epoch == 3  # by hand: always a new one
    await repo.clear_rollback(JOB)
    done = await repo.set_rollback(JOB, 2, from_epoch=0)  # cleared since: a new one
    assert (done.marker.step, done.epoch, done.started) == (2, 4, True)


async def test_ranks_asking_at_once_from_one_timeline_start_one_rollback(repo: Repository
                                                                           ) -> None:
    """Every rank sees the same NaN and asks in the same moment: one new timeline,
    not one per rank (each would refuse the saves of the ranks that rolled back to the
    one before it). The first asker's step is the rollback; the others get it."""
    await commit_all(repo, 1)
    await commit_all(repo, 2)
    asks = [repo.set_rollback(JOB, 1 + rank % 2, from_epoch=0) for rank in range(8)]
    done = await asyncio.gather(*asks)
    assert {d.epoch for d in done} == {1}
    assert sum(d.started for d in done) == 1
    assert len({d.marker for d in done}) == 1
    marker, epoch = await repo.rollback_state(JOB)
    assert (marker, epoch) == (done[0].marker, 1)


async def test_an_operators_rollback_replaces_a_damaged_timeline(repo: Repository,
                                                                 store: Store) -> None:
    """A damaged timeline stops every save and commit of the job (each says how to get
    out); an operator's rollback starts a new one above every timeline the job's
    manifests show, and above the one the damage may have hidden."""
    await commit_all(repo, 1)
    await repo.set_rollback(JOB, 1)
    for m, c in demo_step(JOB, 2, 2, seed="one"):
        await put_rank(repo, in_timeline(m, 1), c)
    assert (await repo.commit(JOB, 2)).state == "committed"
    # Timelines 2 and 3 (the same NaN again at once): nothing saved in either before
    # the damage, so the manifests show timeline 1 at most.
    await repo.set_rollback(JOB, 2)
    await repo.set_rollback(JOB, 2)
    await store.compare_and_swap(timeline_key(JOB), await store.get(timeline_key(JOB)),
                                 b'{"format": "ckptd.timeline", "epo')
    lost = [(in_timeline(m, 3), c) for m, c in demo_step(JOB, 3, 2, seed="lost")]
    with pytest.raises(StoreCorrupt) as info:
        await put_rank(repo, *lost[0])
    assert f"ckptd rollback {JOB} STEP" in info.value.message
    assert info.value.detail["key"] == timeline_key(JOB)
    with pytest.raises(StoreCorrupt):  # a rank's request: it cannot know the lost epoch
        await repo.set_rollback(JOB, 1, from_epoch=3)
    before = int(time.time())
    done = await repo.set_rollback(JOB, 2)  # the operator's
    # Above every timeline the damage may have hidden: the count jumps to the time.
    assert (done.marker.step, done.started) == (2, True) and done.epoch > before
    assert await repo.rollback_state(JOB) == (done.marker, done.epoch)
    with pytest.raises(Superseded):  # a rank still in the lost timeline is told
        await put_rank(repo, *lost[0])
    for m, c in demo_step(JOB, 3, 2, seed="new"):
        await put_rank(repo, in_timeline(m, done.epoch), c)
    assert (await repo.commit(JOB, 3)).state == "committed"


async def test_the_marker_and_epoch_are_read_as_one_pair(repo: Repository, store: Store) -> None:
    """Between set_rollback's two writes (timeline, then marker) a reader must not
    get the previous marker with the new epoch."""
    await commit_all(repo, 1)
    await commit_all(repo, 2)
    await repo.set_rollback(JOB, 2)
    record = await repo.read_commit(JOB, 1)
    # The second rollback wrote its timeline and not yet its marker:
    await store.compare_and_swap(
        timeline_key(JOB), await store.get(timeline_key(JOB)),
        Timeline(epoch=2, step=1, commit=record.digest()).canonical())
    marker, epoch = await repo.rollback_state(JOB)
    assert marker is not None and (marker.step, epoch) == (1, 2)
    await repo.clear_rollback(JOB)
    assert await repo.rollback_state(JOB) == (None, 2)


# -- import_step (ckptd restore --to DIR) -------------------------------------------------


async def test_import_step_copies_one_rank_of_a_committed_step_in_write_order(
    repo: Repository, store: Store
) -> None:
    source = Repository(MemoryStore(), clock=lambda: 1700000000.0)
    parts = demo_step(JOB, 3, 2)
    for manifest, chunks in parts:
        await put_rank(source, manifest, chunks)
    await source.commit(JOB, 3)
    record = await source.read_commit(JOB, 3)
    manifest, chunks = parts[1]

    with pytest.raises(MissingChunks):  # chunks first
        await repo.import_step(record, [manifest])
    assert not await store.exists(manifest_key(JOB, 3, 1))
    for cid, data in chunks.items():
        await repo.put_chunk(cid, data)
    with pytest.raises(ManifestHashMismatch):  # not the committed manifest
        await repo.import_step(record, [replace(manifest, meta={"other": 1})])
    await repo.import_step(record, [manifest])
    assert await repo.read_manifest(JOB, 3, 1) == manifest
    assert await repo.latest(JOB) == 3
    await repo.import_step(record, [manifest])  # again: the same bytes, nothing changes

    # latest moves forward only; a different document under a key is a conflict.
    older = replace(record, step=2)
    await store.put_if_absent(commit_key(JOB, 2), older.canonical())
    await repo.import_step(older, [])
    assert await repo.latest(JOB) == 3
    with pytest.raises(Conflict):
        await repo.import_step(replace(record, meta={"reason": "other"}), [])
