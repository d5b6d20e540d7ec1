"""Properties of restore geometry (``ckptd.client.restore.geometry``): for any global
shape, tiling (world size), chunk size, element size and needed box, filling the
box from the stored boxes' chunks writes each byte exactly once, from the chunk
that holds it, and fetches only chunks that hold a needed byte."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.client.restore.geometry import Box, chunk_ranges, fills, overlap, slice_plan
from ckptd.geometry import c_strides, covering_chunks


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], Box, int, int]:
    """(global shape, stored boxes tiling it, a needed box, item size, chunk size)."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    # A grid tiling: cut points per dimension (uneven, possibly empty pieces); the
    # product of the pieces is one box per rank of a world of that size.
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(0, n), max_size=3))
        points = sorted({0, n, *inner})
        cuts.append([(a, b - a) for a, b in itertools.pairwise(points)] or [(0, 0)])
    stored: list[Box] = [
        (tuple(p[0] for p in pieces), tuple(p[1] for p in pieces))
        for pieces in itertools.product(*cuts)
    ]
    replicas = draw(st.integers(0, 2))  # data-parallel copies of some boxes
    stored += stored[:replicas]
    lo = [draw(st.integers(0, n)) for n in shape]
    hi = [draw(st.integers(a, n)) for a, n in zip(lo, shape, strict=True)]
    needed: Box = (tuple(lo), tuple(h - a for a, h in zip(lo, hi, strict=True)))
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    chunk_size = draw(st.integers(1, 70))
    return shape, stored, needed, itemsize, chunk_size


def global_bytes(shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    """Each byte of the global tensor holds its own global byte index."""
    return np.arange(math.prod(shape) * itemsize, dtype=np.int64).reshape(*shape, itemsize)


def entry_bytes(glob: np.ndarray, box: Box) -> np.ndarray:
    """The stored entry's C-order bytes (as global byte indices)."""
    (o, s) = box
    index = tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))
    return np.ascontiguousarray(glob[index]).reshape(-1)


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_every_byte_of_the_needed_box_is_filled_once_from_the_chunk_holding_it(
    layout: tuple[tuple[int, ...], list[Box], Box, int, int],
) -> None:
    shape, stored, needed, itemsize, chunk_size = layout
    glob = global_bytes(shape, itemsize)
    out = np.full((*needed[1], itemsize), -1, dtype=np.int64)
    writes = np.zeros(needed[1], dtype=np.int64)
    for box, _ in fills(needed, stored):
        plan = slice_plan(needed, box, itemsize, chunk_size)
        assert plan is not None
        data = entry_bytes(glob, box)
        ranges = chunk_ranges(data.size, chunk_size)
        assert plan.base % itemsize == 0 and plan.length % itemsize == 0
        # Only the planned chunks land; every other byte of the buffer is poison.
        landing = np.full(plan.length, -1, dtype=np.int64)
        for k, index in enumerate(plan.chunks):
            a, b = plan.landing(k)
            assert (a, b) == (ranges[index][0] - plan.base, ranges[index][1] - plan.base)
            landing[a:b] = data[ranges[index][0] : ranges[index][1]]
        # The element view the restore copies from (as torch's as_strided).
        pos = np.full(plan.shape, plan.offset, dtype=np.int64)
        for d, (n, stride) in enumerate(zip(plan.shape, plan.strides, strict=True)):
            step = np.arange(n, dtype=np.int64) * stride
            pos = pos + step.reshape([n if e == d else 1 for e in range(len(plan.shape))])
        gathered = landing[pos[..., None] * itemsize + np.arange(itemsize)]
        dst = tuple(slice(o, o + n) for o, n in zip(plan.dst_offsets, plan.shape, strict=True))
        out[dst] = gathered
        writes[dst] += 1
        # Every fetched chunk holds at least one byte the overlap reads.
        read = (pos.reshape(-1) * itemsize)[:, None] + np.arange(itemsize)
        used = set(read.reshape(-1).tolist())
        for index in plan.chunks:
            a, b = ranges[index]
            assert any(a <= plan.base + u < b for u in used), "a chunk fetched for nothing"
    # Each element of the needed box written exactly once, with the right bytes
    # (no poison: nothing read from a chunk that was not fetched).
    assert (writes == 1).all()
    index = tuple(slice(o, o + n) for o, n in zip(*needed, strict=True))
    assert np.array_equal(out, glob[index])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.tuples(*(st.integers(0, n - 1) for n in shape)),
            st.sampled_from([1, 2, 4, 8]),
            st.integers(1, 100),
        )
    ),
    st.data(),
)
def test_covering_chunks_are_exactly_the_chunks_holding_the_sub_box(
    args: tuple[tuple[int, ...], tuple[int, ...], int, int], data: st.DataObject
) -> None:
    shape, lo, itemsize, chunk_size = args
    hi = tuple(data.draw(st.integers(a + 1, n)) for a, n in zip(lo, shape, strict=True))
    strides = c_strides(shape)
    expected = set()
    for idx in itertools.product(*(range(a, b) for a, b in zip(lo, hi, strict=True))):
        start = sum(i * s for i, s in zip(idx, strides, strict=True)) * itemsize
        expected.update(range(start // chunk_size, (start + itemsize - 1) // chunk_size + 1))
    assert covering_chunks(shape, itemsize, chunk_size, lo, hi) == sorted(expected)


def test_boxes_that_only_touch_do_not_overlap_and_scalars_do() -> None:
    assert overlap(((0,), (4,)), ((4,), (4,))) is None
    assert overlap(((0, 0), (4, 0)), ((0, 0), (4, 0))) is None  # no element
    assert overlap(((), ()), ((), ())) == ((), ())
    plan = slice_plan(((), ()), ((), ()), 8, 4096)
    assert plan is not None and plan.chunks == (0,) and plan.shape == ()
