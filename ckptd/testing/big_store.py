"""A store of a million tensor entries in seconds: committed steps written straight
into a store (chunks, rank manifests, commit records, ``latest``), in the format's
canonical bytes but built as text, since building a million ``TensorEntry``
models takes minutes. For tests and benchmarks of what grows with the entry
count (the census, listings); ``tests/lifecycle/test_census_scale.py`` checks
that the bytes are exactly what ``RankManifest(...).canonical()`` writes."""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.format import (
    CommitRecord,
    ManifestRef,
    Ref,
    ValidationReport,
    chunk_key,
    commit_key,
    latest_key,
    manifest_key,
)
from ckptd.hashing import chunk_id, document_hash
from ckptd.knobs import MIN_CHUNK_SIZE
from ckptd.store.base import Store
from ckptd.testing.manifests import filler

CHUNK_BYTES = 64  # each tensor: 16 float32, one chunk


@dataclass(frozen=True, slots=True)
class BigStore:
    jobs: list[str]
    steps: list[int]
    world_size: int
    tensors: int  # per rank manifest
    chunks: dict[str, bytes]  # every chunk the manifests name

    @property
    def entries(self) -> int:
        return len(self.jobs) * len(self.steps) * self.world_size * self.tensors

    @property
    def step_logical_bytes(self) -> int:
        return self.tensors * CHUNK_BYTES  # replicated: each tensor once


def tensor_name(i: int) -> str:
    return f"layers.{i // 8}.p{i % 8}"


def manifest_bytes(job: str, step: int, rank: int, world_size: int, tensors: int,
                   ids: list[str]) -> bytes:
    """Canonical bytes of a rank manifest of ``tensors`` replicated 16-float32
    tensors, the i-th one chunk ``ids[i % len(ids)]``."""
    entries = ",".join(
        f'{{"chunks":["{ids[i % len(ids)]}"],"dtype":"float32","global_shape":[16],'
        f'"name":"{tensor_name(i)}","nbytes":{CHUNK_BYTES},"offsets":[0],'
        f'"placement":"replicated","shape":[16]}}' for i in range(tensors))
    tree = ",".join(f'["{tensor_name(i)}",{{"tensor":"{tensor_name(i)}"}}]'
                    for i in range(tensors))
    return (f'{{"chunk_size":{MIN_CHUNK_SIZE},"entries":[{entries}],'
            f'"format":"ckptd.rank_manifest","job":"{job}","meta":{{}},"rank":{rank},'
            f'"step":{step},"tree":{{"dict":[{tree}]}},"version":1,'
            f'"world_size":{world_size}}}').encode()


def big_chunks(count: int, seed: str = "big") -> dict[str, bytes]:
    out = {}
    for i in range(count):
        data = filler(f"{seed}/{i}", CHUNK_BYTES)
        out[chunk_id(data)] = data
    return out


async def fill(store: Store, *, jobs: list[str], steps: list[int], world_size: int,
               tensors: int, distinct_chunks: int = 1024,
               committed_at: float = 1.7e9) -> BigStore:
    """Writes every (job, step) as a committed step of ``world_size`` ranks."""
    chunks = big_chunks(distinct_chunks)
    ids = sorted(chunks)
    for cid, data in chunks.items():
        await store.put_if_absent(chunk_key(cid), data)
    used = len(set(ids[i % len(ids)] for i in range(min(tensors, len(ids)))))
    for job in jobs:
        for step in steps:
            refs = []
            for rank in range(world_size):
                data = manifest_bytes(job, step, rank, world_size, tensors, ids)
                await store.put_if_absent(manifest_key(job, step, rank), data)
                refs.append(ManifestRef(rank=rank, hash=document_hash(data), size=len(data)))
            record = CommitRecord(
                job=job, step=step, world_size=world_size, manifests=refs,
                report=ValidationReport(tensors=tensors, logical_bytes=tensors * CHUNK_BYTES,
                                        chunks=used, replicated_entries=tensors * world_size,
                                        sharded_entries=0, local_entries=0),
                committed_at=committed_at, meta={})
            await store.put_if_absent(commit_key(job, step), record.canonical())
        ref = Ref(step=max(steps), commit=document_hash(
            await store.get(commit_key(job, max(steps)))))
        await store.put_if_absent(latest_key(job), ref.canonical())
    return BigStore(jobs, steps, world_size, tensors, chunks)
