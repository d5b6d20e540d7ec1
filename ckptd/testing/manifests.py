"""Build rank manifests from raw bytes the way a client does, without torch.

Tests use these to make valid (and, by editing the result, invalid) steps: a
tensor's bytes are cut at fixed offsets of ``chunk_size`` and each piece is named
by its blake3, exactly as ``docs/FORMAT.md`` says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import blake3

from ckptd.dtypes import itemsize
from ckptd.format import Placement, RankManifest, TensorEntry
from ckptd.hashing import chunk_id, chunk_spans
from ckptd.knobs import MIN_CHUNK_SIZE

Chunks = dict[str, bytes]


def filler(seed: str, nbytes: int) -> bytes:
    """``nbytes`` deterministic, incompressible bytes named by ``seed``."""
    return blake3.blake3(seed.encode()).digest(length=nbytes) if nbytes else b""


def split_chunks(data: bytes, chunk_size: int) -> list[tuple[str, bytes]]:
    """(id, bytes) of each fixed-offset chunk of ``data``."""
    return [(chunk_id(data[a:b]), data[a:b]) for a, b in chunk_spans(len(data), chunk_size)]


def tensor_entry(
    name: str,
    dtype: str,
    shape: Sequence[int],
    data: bytes | None = None,
    *,
    placement: Placement = "replicated",
    global_shape: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
    chunk_size: int = MIN_CHUNK_SIZE,
    seed: str | None = None,
) -> tuple[TensorEntry, Chunks]:
    """A tensor entry and its chunks. Without ``data`` the bytes come from
    ``filler(seed or name)``, so equal seeds give equal chunks (replicas)."""
    nbytes = math.prod(shape) * itemsize(dtype)
    if data is None:
        data = filler(seed if seed is not None else name, nbytes)
    if len(data) != nbytes:
        raise ValueError(f"{len(data)} bytes for {list(shape)} of {dtype}")
    pieces = split_chunks(data, chunk_size)
    entry = TensorEntry(
        name=name,
        dtype=dtype,
        placement=placement,
        global_shape=list(global_shape if global_shape is not None else shape),
        offsets=list(offsets if offsets is not None else [0] * len(shape)),
        shape=list(shape),
        nbytes=nbytes,
        chunks=[cid for cid, _ in pieces],
    )
    return entry, dict(pieces)


def flat_tree(names: Iterable[str], values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A tree for a flat state dict: each tensor under its own name, then ``values``."""
    items: list[list[Any]] = [[n, {"tensor": n}] for n in names]
    items.extend([k, {"value": v}] for k, v in (values or {}).items())
    return {"dict": items}


def rank_manifest(
    job: str,
    step: int,
    rank: int,
    world_size: int,
    entries: Sequence[TensorEntry],
    *,
    tree: Any = None,
    chunk_size: int = MIN_CHUNK_SIZE,
    meta: dict[str, Any] | None = None,
) -> RankManifest:
    """A checked rank manifest; the tree defaults to ``flat_tree`` of the entries."""
    manifest = RankManifest(
        job=job,
        step=step,
        rank=rank,
        world_size=world_size,
        chunk_size=chunk_size,
        entries=list(entries),
        tree=tree if tree is not None else flat_tree(e.name for e in entries),
        meta=dict(meta or {}),
    )
    manifest.check()
    return manifest


def merge(*chunk_maps: Chunks) -> Chunks:
    out: Chunks = {}
    for m in chunk_maps:
        out.update(m)
    return out


def replace(model: Any, **changes: Any) -> Any:
    """A copy of a frozen document with fields changed, unchecked (to build bad ones)."""
    return model.model_copy(update=changes)


def demo_step(
    job: str,
    step: int,
    world_size: int,
    *,
    rows: int = 8,
    cols: int = 256,
    chunk_size: int = MIN_CHUNK_SIZE,
    seed: str = "",
) -> list[tuple[RankManifest, Chunks]]:
    """Every rank's manifest and chunks of one step of a small data+model parallel job:
    ``model.w`` replicated (float32), ``model.s`` sharded along dim 0 (bfloat16),
    ``rng`` local to each rank (uint8), and the step as a plain value."""
    out = []
    for rank in range(world_size):
        w, w_chunks = tensor_entry(
            "model.w", "float32", [rows, cols], chunk_size=chunk_size, seed=f"{seed}w/{step}"
        )
        s, s_chunks = tensor_entry(
            "model.s",
            "bfloat16",
            [rows, cols],
            placement="sharded",
            global_shape=[rows * world_size, cols],
            offsets=[rows * rank, 0],
            chunk_size=chunk_size,
            seed=f"{seed}s/{step}/{rank}",
        )
        rng, rng_chunks = tensor_entry(
            "rng", "uint8", [16], placement="local", chunk_size=chunk_size,
            seed=f"{seed}rng/{step}/{rank}",
        )
        tree = {
            "dict": [
                ["model", {"dict": [["w", {"tensor": "model.w"}], ["s", {"tensor": "model.s"}]]}],
                ["rng", {"tensor": "rng"}],
                ["step", {"value": step}],
            ]
        }
        manifest = rank_manifest(
            job, step, rank, world_size, [w, s, rng], tree=tree, chunk_size=chunk_size
        )
        out.append((manifest, merge(w_chunks, s_chunks, rng_chunks)))
    return out


async def put_rank(repo: Any, manifest: RankManifest, chunks: Chunks) -> str:
    """Sends what a rank's manifest needs that the store lacks, then the manifest."""
    missing = (await repo.missing_chunks(sorted(chunks))).missing
    for cid in missing:
        await repo.put_chunk(cid, chunks[cid])
    digest: str = await repo.put_manifest(manifest)
    return digest


def many_tensor_manifests(job: str, step: int, world: int, tensors: int
                          ) -> tuple[list[RankManifest], bytes]:
    """``world`` rank manifests of ``tensors`` replicated tensors each (a large
    mixture-of-experts model's count), every one a single chunk of the same 64
    bytes: one chunk upload serves them all, so only the manifests are large."""
    data = bytes(range(64))
    cid = chunk_id(data)
    entries = [
        TensorEntry(name=f"layers.{i // 8}.p{i % 8}", dtype="float32", placement="replicated",
                    global_shape=[16], offsets=[0], shape=[16], nbytes=len(data), chunks=[cid])
        for i in range(tensors)
    ]
    tree = flat_tree(e.name for e in entries)
    manifests = [
        RankManifest(job=job, step=step, rank=r, world_size=world, chunk_size=MIN_CHUNK_SIZE,
                     entries=entries, tree=tree)
        for r in range(world)
    ]
    return manifests, data
