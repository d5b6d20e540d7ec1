"""Cross-rank validation: do the rank manifests of a step form one checkpoint?"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from itertools import zip_longest
from typing import Literal

from ckptd.dtypes import itemsize
from ckptd.errors import (
    ChunkLayoutMismatch,
    DtypeMismatch,
    JobMismatch,
    ReplicaMismatch,
    ShapeMismatch,
    ShardOutOfBounds,
    StepMismatch,
    TilingGap,
    TilingOverlap,
    WorldSizeMismatch,
)
from ckptd.format import RankManifest, TensorEntry, ValidationReport

ReplicaPolicy = Literal["reject", "warn"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def validate_step(
    manifests: Sequence[RankManifest], *, replica_mismatch: ReplicaPolicy = "reject"
) -> ValidationReport:
    """Checks every rule of a step across its ranks; raises the first broken one.

    Same job, step and world size; one manifest per rank; per global tensor the
    same dtype and global shape everywhere; distinct shards tile the global shape
    with no gap and no overlap; identical shards (replicas) carry identical chunk
    ids. Whether the chunks exist is the repository's check, not this one."""
    first = manifests[0]
    ranks = sorted(m.rank for m in manifests)
    for m in manifests:
        if m.job != first.job:
            raise JobMismatch(f"rank {m.rank} says job {m.job!r}, rank {first.rank} {first.job!r}")
        if m.step != first.step:
            raise StepMismatch(f"rank {m.rank} says step {m.step}, rank {first.rank} {first.step}")
        if m.world_size != first.world_size:
            raise WorldSizeMismatch(
                f"rank {m.rank} says world size {m.world_size}, "
                f"rank {first.rank} {first.world_size}"
            )
    for m in manifests:
        if m.chunk_size != first.chunk_size:
            # Replicas are compared by chunk id, and ids depend on where chunks are cut.
            raise ChunkLayoutMismatch(
                f"rank {m.rank} cuts chunks of {m.chunk_size} bytes, rank {first.rank} of "
                f"{first.chunk_size}: every rank of a step must use the same chunk size",
                ranks=[first.rank, m.rank],
            )
    if ranks != list(range(first.world_size)):
        raise WorldSizeMismatch(
            f"step {first.step} needs ranks 0..{first.world_size - 1}, has {ranks[:20]}"
        )

    by_name: dict[str, list[tuple[int, TensorEntry]]] = defaultdict(list)
    counts = {"replicated": 0, "sharded": 0, "local": 0}
    local_bytes = 0
    for m in manifests:
        for e in m.entries:
            counts[e.placement] += 1
            if e.placement == "local":
                local_bytes += e.nbytes  # rank-private state: nothing to agree on
            else:
                by_name[e.name].append((m.rank, e))

    warnings: list[str] = []
    logical = local_bytes
    mismatched: list[ReplicaMismatch] = []
    for name, held in by_name.items():
        try:
            logical += _check_tensor(name, held, replica_mismatch, warnings)
        except ReplicaMismatch as exc:  # name every disagreeing tensor, not the first
            mismatched.append(exc)
    if mismatched:
        head = mismatched[0]
        names = [str(e.detail.get("name")) for e in mismatched]
        more = (f"; {len(names) - 1} more tensors differ too: "
                + ", ".join(repr(n) for n in names[1:11]) if len(names) > 1 else "")
        raise ReplicaMismatch(head.message + more, name=names[0], names=names[:50],
                              ranks=head.detail.get("ranks"))

    chunks = {cid for m in manifests for e in m.entries for cid in e.chunks}
    return ValidationReport(
        tensors=len(by_name),
        logical_bytes=logical,
        chunks=len(chunks),
        replicated_entries=counts["replicated"],
        sharded_entries=counts["sharded"],
        local_entries=counts["local"],
        warnings=warnings,
    )


def _check_tensor(
    name: str,
    held: list[tuple[int, TensorEntry]],
    replica_mismatch: ReplicaPolicy,
    warnings: list[str],
) -> int:
    """Validates one global tensor across the ranks that hold parts of it; returns
    its size in bytes."""
    rank0, e0 = held[0]
    for rank, e in held[1:]:
        if e.dtype != e0.dtype:
            raise DtypeMismatch(
                f"{name!r}: rank {rank} has {e.dtype}, rank {rank0} has {e0.dtype}",
                name=name,
                ranks=[rank0, rank],
            )
        if e.global_shape != e0.global_shape:
            raise ShapeMismatch(
                f"{name!r}: rank {rank} has global shape {e.global_shape}, "
                f"rank {rank0} has {e0.global_shape}",
                name=name,
                ranks=[rank0, rank],
            )

    if len(held) == 1:  # one rank holds it (experts, one-rank jobs): no replica, no overlap
        _check_inside(name, rank0, e0, e0.global_shape)
        volume = math.prod(e0.global_shape)
        _check_covered(name, math.prod(e0.shape), volume, e0.global_shape)
        return volume * itemsize(e0.dtype)

    # Identical boxes are replicas of one shard; they must hold identical bytes.
    boxes: dict[Box, tuple[int, TensorEntry]] = {}
    for rank, e in held:
        _check_inside(name, rank, e, e0.global_shape)
        box = (tuple(e.offsets), tuple(e.shape))
        if box not in boxes:
            boxes[box] = (rank, e)
            continue
        other_rank, other = boxes[box]
        if other.chunks != e.chunks:
            # Counts differ only when the ranks used different chunk sizes.
            bad = sum(a != b for a, b in zip_longest(other.chunks, e.chunks))
            message = (
                f"{name!r}: replicas on ranks {other_rank} and {rank} differ in {bad} of "
                f"{len(e.chunks)} chunks (silent corruption or non-determinism)"
            )
            if replica_mismatch == "reject":
                raise ReplicaMismatch(message, name=name, ranks=[other_rank, rank])
            warnings.append(message)

    global_shape = tuple(e0.global_shape)
    volume = math.prod(global_shape)
    covered = sum(math.prod(shape) for _, shape in boxes)
    if len(boxes) > 1:  # (one box overlaps nothing: replicas, and the sort is not free)
        _check_no_overlap(name, boxes)
    _check_covered(name, covered, volume, e0.global_shape)
    return volume * itemsize(e0.dtype)


def _check_inside(name: str, rank: int, e: TensorEntry, global_shape: list[int]) -> None:
    # RankManifest.check() refuses these already; the tiling sum is only sound for
    # boxes inside the global shape, so do not rely on the caller.
    if not len(e.offsets) == len(e.shape) == len(global_shape) or any(
        o < 0 or s < 0 or o + s > g
        for o, s, g in zip(e.offsets, e.shape, global_shape, strict=False)
    ):
        raise ShardOutOfBounds(
            f"{name!r}: rank {rank}'s shard {e.offsets}+{e.shape} is outside {global_shape}",
            name=name,
            ranks=[rank],
        )


def _check_covered(name: str, covered: int, volume: int, global_shape: list[int]) -> None:
    if covered != volume:
        raise TilingGap(
            f"{name!r}: shards cover {covered} of {volume} elements of {list(global_shape)}",
            name=name,
        )


def _check_no_overlap(name: str, boxes: dict[Box, tuple[int, TensorEntry]]) -> None:
    # Sweep along dimension 0: only boxes whose dim-0 ranges meet can overlap, so a
    # Shard(0) layout costs O(n log n), not O(n^2).
    items = sorted(
        ((off, shape, rank) for (off, shape), (rank, _) in boxes.items() if math.prod(shape)),
        key=lambda b: b[0],
    )
    if items and not items[0][0]:  # zero-dimensional: at most one non-empty box
        if len(items) > 1:
            raise TilingOverlap(f"{name!r}: scalar held by several distinct shards", name=name)
        return
    for i, (off_a, shape_a, rank_a) in enumerate(items):
        end_a0 = off_a[0] + shape_a[0]
        for off_b, shape_b, rank_b in items[i + 1 :]:
            if off_b[0] >= end_a0:
                break
            if all(
                oa < ob + sb and ob < oa + sa
                for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b, strict=True)
            ):
                raise TilingOverlap(
                    f"{name!r}: shards of ranks {rank_a} ({list(off_a)}+{list(shape_a)}) and "
                    f"{rank_b} ({list(off_b)}+{list(shape_b)}) overlap",
                    name=name,
                    ranks=[rank_a, rank_b],
                )
