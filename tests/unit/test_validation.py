"""Cross-rank validation: every rule, its error code, and tilings found by hypothesis."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    ValidationFailed,
    WorldSizeMismatch,
)
from ckptd.format import RankManifest, TensorEntry
from ckptd.testing.manifests import demo_step, rank_manifest, replace, tensor_entry
from ckptd.validation import validate_step

Box = tuple[tuple[int, ...], tuple[int, ...]]


def shard(
    name: str,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    *,
    dtype: str = "uint8",
    seed: str | None = None,
) -> TensorEntry:
    e, _ = tensor_entry(
        name, dtype, shape, placement="sharded", global_shape=global_shape, offsets=offsets,
        seed=seed if seed is not None else f"{name}{list(offsets)}{list(shape)}",
    )
    return e


def step_of(per_rank: Sequence[Sequence[TensorEntry]], job: str = "j", step: int = 1
            ) -> list[RankManifest]:
    world = len(per_rank)
    return [rank_manifest(job, step, r, world, list(es)) for r, es in enumerate(per_rank)]


def boxes_step(name: str, global_shape: Sequence[int], boxes: Sequence[Box]) -> list[RankManifest]:
    """One rank per box."""
    return step_of([[shard(name, global_shape, off, shp)] for off, shp in boxes])


def code_of(manifests: Sequence[RankManifest], **kw: Any) -> str:
    with pytest.raises(ValidationFailed) as info:
        validate_step(manifests, **kw)
    return info.value.code


# -- a good step and its report ------------------------------------------------------------


def test_a_consistent_step_validates_and_reports() -> None:
    manifests = [m for m, _ in demo_step("j", 4, 4, rows=8, cols=256)]
    report = validate_step(manifests)
    assert report.tensors == 2  # model.w and model.s; rng is local
    assert report.replicated_entries == 4
    assert report.sharded_entries == 4
    assert report.local_entries == 4
    w = 8 * 256 * 4
    s = 4 * 8 * 256 * 2
    rng = 4 * 16
    assert report.logical_bytes == w + s + rng
    distinct = {c for m in manifests for e in m.entries for c in e.chunks}
    assert report.chunks == len(distinct)
    assert report.warnings == []


def test_order_of_manifests_does_not_matter() -> None:
    manifests = [m for m, _ in demo_step("j", 4, 3)]
    assert validate_step(manifests[::-1]) == validate_step(manifests)


# -- header rules --------------------------------------------------------------------------


def test_job_mismatch() -> None:
    a, b = [m for m, _ in demo_step("j", 1, 2)]
    assert code_of([a, replace(b, job="other")]) == "job_mismatch"
    with pytest.raises(JobMismatch):
        validate_step([a, replace(b, job="other")])


def test_step_mismatch() -> None:
    a, b = [m for m, _ in demo_step("j", 1, 2)]
    with pytest.raises(StepMismatch):
        validate_step([a, replace(b, step=2)])


def test_world_size_mismatch() -> None:
    a, b = [m for m, _ in demo_step("j", 1, 2)]
    with pytest.raises(WorldSizeMismatch):
        validate_step([a, replace(b, world_size=3)])
    with pytest.raises(WorldSizeMismatch):  # a rank is missing
        validate_step([a])
    with pytest.raises(WorldSizeMismatch):  # a rank twice, another missing
        validate_step([a, a])
    with pytest.raises(WorldSizeMismatch):  # ranks 0..1 of a world of 3
        validate_step([replace(a, world_size=3), replace(b, world_size=3)])


# -- per-tensor rules ----------------------------------------------------------------------


def test_dtype_mismatch() -> None:
    a = shard("t", [8], [0], [4], dtype="uint8")
    b = shard("t", [8], [4], [4], dtype="int8")
    with pytest.raises(DtypeMismatch) as info:
        validate_step(step_of([[a], [b]]))
    assert info.value.detail["name"] == "t"
    assert info.value.detail["ranks"] == [0, 1]


def test_shape_mismatch() -> None:
    a = shard("t", [8], [0], [4])
    b = shard("t", [9], [4], [5])
    with pytest.raises(ShapeMismatch):
        validate_step(step_of([[a], [b]]))
    r1, _ = tensor_entry("r", "float32", [2, 3])
    r2, _ = tensor_entry("r", "float32", [3, 2])
    with pytest.raises(ShapeMismatch):
        validate_step(step_of([[r1], [r2]]))


def test_tiling_gap() -> None:
    with pytest.raises(TilingGap) as info:
        validate_step(boxes_step("t", [10], [((0,), (4,)), ((5,), (5,))]))
    assert info.value.code == "tiling_gap"
    # a tensor that one rank shards and no other rank completes
    with pytest.raises(TilingGap):
        validate_step(step_of([[shard("t", [10], [0], [5])], []]))


def test_tiling_overlap() -> None:
    with pytest.raises(TilingOverlap) as info:
        validate_step(boxes_step("t", [10], [((0,), (6,)), ((5,), (5,))]))
    assert info.value.detail["ranks"] == [0, 1]
    # overlap is found even when the total element count happens to match
    with pytest.raises(TilingOverlap):
        validate_step(boxes_step("t", [10], [((0,), (6,)), ((4,), (4,))]))


def test_shard_out_of_bounds_even_if_the_caller_skipped_check() -> None:
    manifests = step_of([[shard("t", [10], [0], [6])], [shard("t", [10], [6], [4])]])
    outside = replace(manifests[1].entries[0], offsets=[8])  # 8..12 of 10
    manifests[1] = replace(manifests[1], entries=[outside])  # unchecked, as if hand-made
    with pytest.raises(ShardOutOfBounds):
        validate_step(manifests)


def test_replica_mismatch_rejected_by_default() -> None:
    a, _ = tensor_entry("w", "float32", [4, 4096], seed="same")  # 16 chunks
    b, _ = tensor_entry("w", "float32", [4, 4096], seed="same")
    data = bytearray(4 * 4096 * 4)
    c, _ = tensor_entry("w", "float32", [4, 4096], bytes(data))
    validate_step(step_of([[a], [b]]))
    with pytest.raises(ReplicaMismatch) as info:
        validate_step(step_of([[a], [b], [c]]))
    assert info.value.code == "replica_mismatch"
    assert info.value.detail["ranks"] == [0, 2]
    assert "16 of 16 chunks" in str(info.value)


def test_replica_mismatch_names_every_tensor_that_differs() -> None:
    same, _ = tensor_entry("w", "float32", [8], seed="same")
    rng0, _ = tensor_entry("rng", "uint8", [16], seed="r0")
    rng1, _ = tensor_entry("rng", "uint8", [16], seed="r1")
    n0, _ = tensor_entry("seen", "int64", [1], seed="n0")
    n1, _ = tensor_entry("seen", "int64", [1], seed="n1")
    with pytest.raises(ReplicaMismatch) as info:
        validate_step(step_of([[same, rng0, n0], [same, rng1, n1]]))
    assert info.value.detail["names"] == ["rng", "seen"]
    assert "'rng'" in str(info.value) and "'seen'" in str(info.value)


def test_replica_mismatch_warns_by_policy() -> None:
    a, _ = tensor_entry("w", "float32", [4, 4096], seed="one")
    b, _ = tensor_entry("w", "float32", [4, 4096], seed="two")
    report = validate_step(step_of([[a], [b]]), replica_mismatch="warn")
    assert len(report.warnings) == 1
    assert "'w'" in report.warnings[0] and "ranks 0 and 1" in report.warnings[0]


def test_ranks_with_different_chunk_sizes_are_refused_by_name() -> None:
    # Replicas are compared by chunk ids; different chunk sizes give other ids, and
    # calling that "silent corruption" would send the operator the wrong way.
    data = bytes(range(256)) * 64
    a, _ = tensor_entry("w", "uint8", [len(data)], data, chunk_size=4096)
    b, _ = tensor_entry("w", "uint8", [len(data)], data, chunk_size=8192)
    m0 = rank_manifest("j", 1, 0, 2, [a], chunk_size=4096)
    m1 = rank_manifest("j", 1, 1, 2, [b], chunk_size=8192)
    with pytest.raises(ChunkLayoutMismatch) as info:
        validate_step([m0, m1])
    assert info.value.detail["ranks"] == [0, 1]


def test_local_entries_need_no_agreement() -> None:
    a, _ = tensor_entry("rng", "uint8", [16], placement="local", seed="a")
    b, _ = tensor_entry("rng", "int64", [3], placement="local", seed="b")
    report = validate_step(step_of([[a], [b], []]))
    assert report.tensors == 0
    assert report.local_entries == 2
    assert report.logical_bytes == 16 + 24


# -- layouts -------------------------------------------------------------------------------


def test_2d_sharding_on_a_2x2_grid() -> None:
    g = [6, 10]
    grid = [((0, 0), (3, 5)), ((0, 5), (3, 5)), ((3, 0), (3, 5)), ((3, 5), (3, 5))]
    report = validate_step(boxes_step("t", g, grid))
    assert report.tensors == 1 and report.logical_bytes == 60
    assert report.sharded_entries == 4
    with pytest.raises(TilingGap):
        validate_step(boxes_step("t", g, grid[:3]))
    shifted = grid[:3] + [((3, 4), (3, 5))]  # covers 60 elements, one column twice
    with pytest.raises(TilingOverlap):
        validate_step(boxes_step("t", g, shifted))
    overlapping = grid[:3] + [((2, 5), (3, 5))]
    with pytest.raises(TilingOverlap):
        validate_step(boxes_step("t", g, overlapping))


def test_column_sharding() -> None:
    cols = [((0, c), (4, 2)) for c in range(0, 16, 2)]
    validate_step(boxes_step("t", [4, 16], cols))


def test_hsdp_identical_boxes_on_several_ranks() -> None:
    # 2 shard groups x 2 replicas: ranks 0,2 hold rows 0..3, ranks 1,3 rows 4..7.
    def hsdp(rank: int, seed_of: Any = None) -> TensorEntry:
        half = rank % 2
        return shard("t", [8, 64], [4 * half, 0], [4, 64],
                     seed=seed_of(rank) if seed_of else f"half{half}")

    report = validate_step(step_of([[hsdp(r)] for r in range(4)]))
    assert report.tensors == 1 and report.logical_bytes == 8 * 64
    assert report.sharded_entries == 4
    bad = step_of([[hsdp(r, lambda r: "x" if r == 3 else f"half{r % 2}")] for r in range(4)])
    with pytest.raises(ReplicaMismatch) as info:
        validate_step(bad)
    assert info.value.detail["ranks"] == [1, 3]


def test_zero_size_tensors() -> None:
    empty, _ = tensor_entry("e", "float32", [0, 8])
    assert empty.nbytes == 0 and empty.chunks == []
    report = validate_step(step_of([[empty], [empty]]))
    assert report.tensors == 1 and report.logical_bytes == 0
    # empty shards hold no element, so they can neither leave a gap nor overlap
    halves = [shard("z", [4, 0], [0, 0], [2, 0]), shard("z", [4, 0], [2, 0], [2, 0])]
    validate_step(step_of([[h] for h in halves]))
    validate_step(step_of([[halves[0]], []]))


def test_zero_dimensional_tensors() -> None:
    scalar, _ = tensor_entry("lr", "float64", [])
    assert scalar.shape == [] and scalar.nbytes == 8 and len(scalar.chunks) == 1
    report = validate_step(step_of([[scalar], [scalar]]))
    assert report.tensors == 1 and report.logical_bytes == 8
    # a "sharded" scalar held by one rank only is whole
    one = shard("s", [], [], [])
    validate_step(step_of([[one], []]))
    other, _ = tensor_entry("lr", "float64", [], seed="other")
    with pytest.raises(ReplicaMismatch):
        validate_step(step_of([[scalar], [other]]))


def test_many_row_shards_validate_quickly() -> None:
    # Shard(0) across a large world: the sweep must not be quadratic in practice.
    world = 512
    manifests = boxes_step("t", [world, 4], [((r, 0), (1, 4)) for r in range(world)])
    assert validate_step(manifests).tensors == 1


# -- tilings found by hypothesis -----------------------------------------------------------


@st.composite
def partitions(draw: st.DrawFn, dims: int) -> tuple[list[int], list[Box]]:
    """A global shape and a random guillotine partition of it into non-empty boxes."""
    shape = [draw(st.integers(1, 12)) for _ in range(dims)]
    boxes: list[Box] = [(tuple([0] * dims), tuple(shape))]
    for _ in range(draw(st.integers(0, 7))):
        i = draw(st.integers(0, len(boxes) - 1))
        off, shp = boxes[i]
        d = draw(st.integers(0, dims - 1))
        if shp[d] < 2:
            continue
        cut = draw(st.integers(1, shp[d] - 1))
        left = (off, tuple(cut if k == d else s for k, s in enumerate(shp)))
        right = (
            tuple(o + cut if k == d else o for k, o in enumerate(off)),
            tuple(s - cut if k == d else s for k, s in enumerate(shp)),
        )
        boxes[i : i + 1] = [left, right]
    order = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[k] for k in order]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 2).flatmap(partitions))
def test_random_partitions_validate(case: tuple[list[int], list[Box]]) -> None:
    shape, boxes = case
    report = validate_step(boxes_step("t", shape, boxes))
    assert report.logical_bytes == math.prod(shape)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 2).flatmap(partitions), st.data())
def test_removing_a_box_leaves_a_gap(case: tuple[list[int], list[Box]], data: st.DataObject
                                     ) -> None:
    shape, boxes = case
    drop = data.draw(st.integers(0, len(boxes) - 1))
    per_rank = [[shard("t", shape, off, shp)] for off, shp in boxes]
    per_rank[drop] = []  # the rank is there, its shard is not
    if len(boxes) == 1:  # no rank names the tensor: it is not part of the step at all
        assert validate_step(step_of(per_rank)).tensors == 0
        return
    with pytest.raises(TilingGap):
        validate_step(step_of(per_rank))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 2).flatmap(partitions), st.data())
def test_growing_a_box_over_its_edge_overlaps(
    case: tuple[list[int], list[Box]], data: st.DataObject
) -> None:
    shape, boxes = case
    # grow one box by one element across an edge that a neighbour shares
    growable = [
        (i, d) for i, (off, shp) in enumerate(boxes) for d in range(len(shape))
        if off[d] + shp[d] < shape[d]
    ]
    if not growable:  # one box covering everything: no edge to grow across
        assert len(boxes) == 1
        return
    i, d = data.draw(st.sampled_from(growable))
    off, shp = boxes[i]
    boxes = list(boxes)
    boxes[i] = (off, tuple(s + 1 if k == d else s for k, s in enumerate(shp)))
    with pytest.raises(TilingOverlap):
        validate_step(boxes_step("t", shape, boxes))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2).flatmap(partitions), st.data())
def test_duplicating_a_box_as_a_different_shard_overlaps(
    case: tuple[list[int], list[Box]], data: st.DataObject
) -> None:
    shape, boxes = case
    i = data.draw(st.integers(0, len(boxes) - 1))
    off, shp = boxes[i]
    # the same box again is a replica (fine); the same box minus an edge is an overlap
    d = data.draw(st.integers(0, len(shape) - 1))
    if shp[d] < 2:
        return
    smaller = (off, tuple(s - 1 if k == d else s for k, s in enumerate(shp)))
    with pytest.raises(TilingOverlap):
        validate_step(boxes_step("t", shape, [*boxes, smaller]))
    replica_step = step_of(
        [[shard("t", shape, o, s, seed=f"{o}{s}")] for o, s in [*boxes, boxes[i]]]
    )
    validate_step(replica_step)


# -- several shards of one tensor on one rank (format 1.3) ---------------------------------


def _ranks_holding(per_rank: Sequence[Sequence[tuple[int, int]]]) -> list[RankManifest]:
    """Each rank holds the given row ranges [start, stop) of one [8, 16] tensor 't'."""
    from ckptd.testing.manifests import flat_tree

    return [
        rank_manifest("j", 1, r, len(per_rank),
                      [shard("t", [8, 16], [a, 0], [b - a, 16]) for a, b in rows],
                      tree=flat_tree(["t"]))
        for r, rows in enumerate(per_rank)
    ]


def test_local_shards_of_several_ranks_tile_one_tensor() -> None:
    # ChunkShardingSpec placements [rank:0, rank:1, rank:1, rank:0]
    report = validate_step(_ranks_holding([[(0, 2), (6, 8)], [(2, 4), (4, 6)]]))
    assert (report.tensors, report.sharded_entries, report.logical_bytes) == (1, 4, 8 * 16)
    assert validate_step(_ranks_holding([[(0, 3), (3, 8)]])).tensors == 1  # one rank, all


def test_local_shards_that_leave_a_gap_or_overlap_another_ranks_are_refused() -> None:
    assert code_of(_ranks_holding([[(0, 2), (6, 8)], [(2, 5)]])) == "tiling_gap"
    assert code_of(_ranks_holding([[(0, 3), (6, 8)], [(2, 6)]])) == "tiling_overlap"
    assert code_of(_ranks_holding([[(0, 2), (5, 8)]])) == "tiling_gap"
