"""The reads under every flow of the repository: a chunk, a rank manifest (raw,
or checked against its commit record), a commit record, the ``latest`` ref."""

from __future__ import annotations

import asyncio

from ckptd.documents import ParsedManifests, parse_stored
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkNotFound,
    ManifestNotFound,
    NotCommitted,
    NotFound,
    StoreCorrupt,
)
from ckptd.format import (
    MAX_STEP,
    CommitRecord,
    RankManifest,
    Ref,
    chunk_key,
    commit_key,
    job_prefix,
    latest_key,
    manifest_key,
    removal_key,
    step_prefix,
)
from ckptd.hashing import chunk_id, document_hash
from ckptd.store.base import Store


def committed_rank(record: CommitRecord, rank: int) -> int:
    """``rank`` if the committed step of ``record`` has it; else ``ManifestNotFound``
    naming the step's world size: a rank past it has no manifest, as a step that
    never was has no record (a 404, not a bad request)."""
    if not 0 <= rank < record.world_size:
        last = record.world_size - 1
        raise ManifestNotFound(
            f"step {record.step} of {record.job} has world size {record.world_size}: no "
            f"rank {rank} (its ranks are 0 to {last})", job=record.job, step=record.step,
            rank=rank, world_size=record.world_size)
    return rank


class StoredReads:
    """The reads every flow shares: chunks, rank manifests, commit records, the
    ``latest`` ref and the step directories, parsed and checked."""

    store: Store
    _manifests: ParsedManifests

    async def has_chunk(self, cid: str) -> bool:
        return await self.store.exists(chunk_key(cid))

    async def get_chunk(self, cid: str, *, verify: bool = True) -> bytes:
        try:
            data = await self.store.get(chunk_key(cid))
        except NotFound:
            raise ChunkNotFound(f"chunk {cid} is not in the store", id=cid) from None
        if verify:
            actual = await asyncio.to_thread(chunk_id, data)
            if actual != cid:
                raise ChunkHashMismatch(
                    f"stored chunk {cid} is corrupt (hashes to {actual})", id=cid, actual=actual
                )
        return data

    async def _ranks_present(self, job: str, step: int) -> list[int]:
        names = await self.store.list_dir(f"{step_prefix(job, step)}ranks/")
        ranks = []
        for n in names:
            if n.endswith(".json") and n[:-5].isdigit():
                ranks.append(int(n[:-5]))
        return sorted(ranks)

    async def _read_manifest_raw(self, job: str, step: int, rank: int) -> RankManifest:
        try:
            data = await self.store.get(manifest_key(job, step, rank))
        except NotFound:
            raise ManifestNotFound(
                f"no manifest of rank {rank} for step {step} of {job}", rank=rank
            ) from None
        return await self._manifests.parse(manifest_key(job, step, rank), data)

    async def read_manifest(self, job: str, step: int, rank: int) -> RankManifest:
        """A rank's manifest of a committed step, checked against the commit record."""
        record = await self.read_commit(job, step)
        return await self._read_committed_manifest(record, committed_rank(record, rank))

    async def _read_committed_manifest(self, record: CommitRecord, rank: int) -> RankManifest:
        """``read_manifest`` with the commit record already read."""
        job, step = record.job, record.step
        key = manifest_key(job, step, rank)
        # A committed step's manifest missing or not its committed bytes is store
        # damage (a 5xx naming the document), never the caller's request.
        try:
            data = await self.store.get(key)
        except NotFound:
            # Retention removes the record first, then the manifests: a step read
            # while it goes is not damage.
            await self.read_commit(job, step)  # CheckpointNotFound once it is gone
            if await self.store.exists(removal_key(job, step)):
                raise CheckpointNotFound(
                    f"step {step} of {job} is being removed by retention; list the "
                    f"steps that remain with: ckptd ls {job}", job=job, step=step) from None
            raise StoreCorrupt(
                f"damaged step: {key}, named by the commit record of step {step} of {job}, "
                "is missing", key=key, job=job, step=step, rank=rank) from None
        # Hash the stored bytes before parsing them: bytes that are not the
        # committed ones are refused whatever they say.
        expected = record.manifests[rank].hash
        if await asyncio.to_thread(document_hash, data) != expected:
            raise StoreCorrupt(
                f"damaged document {key}: its bytes are not those the commit record of "
                f"step {step} of {job} names", key=key, job=job, step=step, rank=rank)
        return await self._manifests.parse(key, data, expected)

    async def _try_read_commit(self, job: str, step: int) -> CommitRecord | None:
        try:
            data = await self.store.get(commit_key(job, step))
        except NotFound:
            return None
        key = commit_key(job, step)
        record = parse_stored(CommitRecord.parse, data, key)
        if record.job != job or record.step != step:  # a record copied to another key
            raise StoreCorrupt(
                f"damaged document {key}: the commit record names step {record.step} of "
                f"{record.job}", key=key,
            )
        return record

    async def record_lost(self, job: str, step: int) -> bool:
        """Whether ``step``, which the caller found a ref names (``latest``, the
        rollback marker, a tag: each set on committed steps only; a step no ref
        names is pending, not this), has lost its commit record: its
        rank manifests are there, and no retention pass is removing it (one that
        stopped midway leaves the manifests and its claim). Such a step is damaged,
        never pending: retention must not abandon it."""
        return (not await self.store.exists(commit_key(job, step))
                and bool(await self._ranks_present(job, step))
                and not await self.store.exists(removal_key(job, step)))

    async def read_commit(self, job: str, step: int) -> CommitRecord:
        record = await self._try_read_commit(job, step)
        if record is not None:
            return record
        if await self._ranks_present(job, step):
            if await self.store.exists(removal_key(job, step)):
                # Retention deletes the record first, then the manifests under its
                # claim: the step was (or was never) a checkpoint, and is going.
                raise CheckpointNotFound(
                    f"step {step} of {job} is being removed by retention; list the "
                    f"steps that remain with: ckptd ls {job}", job=job, step=step)
            if (lost := await self.lost_commit(job, step)) is not None:
                raise StoreCorrupt(f"{lost}; `ckptd forget {job} --step {step}` forgets it",
                                   key=commit_key(job, step), job=job, step=step)
            raise NotCommitted(f"step {step} of {job} never committed", job=job, step=step)
        raise CheckpointNotFound(f"no checkpoint at step {step} of {job}", job=job, step=step)

    async def lost_commit(self, job: str, step: int) -> str | None:
        """What is wrong with ``step`` when a ref names it and its commit record is
        lost (``record_lost``), else None: the repository's listings know."""
        return None

    async def latest_ref_step(self, job: str) -> int | None:
        """The step the ``latest`` ref names, damaged or not, or None."""
        ref = await self._latest_ref(job)
        return ref.step if ref is not None else None

    async def _latest_ref(self, job: str) -> Ref | None:
        try:
            data = await self.store.get(latest_key(job))
        except NotFound:
            return None
        return parse_stored(Ref.parse, data, latest_key(job))

    async def step_numbers(self, job: str) -> list[int]:
        """Every step of ``job`` that has a directory (committed or pending), ascending."""
        names = await self.store.list_dir(f"{job_prefix(job)}steps/")
        return sorted(int(n) for n in names if n.isdigit() and int(n) < MAX_STEP)

    async def try_read_commit(self, job: str, step: int) -> CommitRecord | None:
        """The commit record of ``step``, or None when it has not committed."""
        return await self._try_read_commit(job, step)

    async def ranks_present(self, job: str, step: int) -> list[int]:
        """The ranks whose manifests of ``step`` are in the store."""
        return await self._ranks_present(job, step)
