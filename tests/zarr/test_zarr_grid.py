"""Property tests of the zarr view's grid: every zarr chunk is the right bytes."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.zarr.grid import (
    Box,
    assemble,
    choose_grid,
    chunk_indices,
    chunk_region,
    needed_chunks,
    strides_of,
)


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int, list[tuple[list[int], list[int]]]]:
    """A global shape, an itemsize, a chunk size and boxes that tile the shape."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    chunk_size = draw(st.one_of(st.integers(1, 80), st.sampled_from([8, 16, 32, 64, 128])))
    cuts = []
    for s in shape:
        inner = draw(st.sets(st.integers(1, s - 1), max_size=2)) if s > 1 else set()
        edges = [0, *sorted(inner), s]
        cuts.append(list(zip(edges, edges[1:], strict=False)))
    boxes = []
    for spans in (np.ndindex(*[len(c) for c in cuts]) if cuts else [()]):
        lo = [cuts[d][i][0] for d, i in enumerate(spans)]
        hi = [cuts[d][i][1] for d, i in enumerate(spans)]
        boxes.append((lo, [h - low for low, h in zip(lo, hi, strict=True)]))
    return shape, itemsize, chunk_size, boxes


def _store(tensor: np.ndarray, boxes: list[tuple[list[int], list[int]]], chunk_size: int
           ) -> tuple[list[Box], dict[tuple[int, int], bytes]]:
    """Cuts each box's C-order bytes at fixed offsets, as ckptd stores them."""
    out, data = [], {}
    for b, (lo, shape) in enumerate(boxes):
        region = tensor[tuple(slice(o, o + s) for o, s in zip(lo, shape, strict=True))]
        raw = np.ascontiguousarray(region).tobytes()
        n = -(-len(raw) // chunk_size)
        ids = []
        for k in range(n):
            data[(b, k)] = raw[k * chunk_size : (k + 1) * chunk_size]
            ids.append(f"{b}.{k}")
        out.append(Box(tuple(lo), tuple(shape), tuple(ids)))
    return out, data


@settings(max_examples=300, deadline=None)
@given(tilings(), st.randoms(use_true_random=False))
def test_every_zarr_chunk_is_the_tensor_region_it_covers(case, rnd) -> None:  # type: ignore[no-untyped-def]
    shape, itemsize, chunk_size, box_specs = case
    rng = np.random.default_rng(rnd.randint(0, 2**32))
    tensor = rng.integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    boxes, data = _store(tensor, box_specs, chunk_size)
    grid = choose_grid(shape, itemsize, chunk_size, boxes)
    seen = 0
    for index in chunk_indices(grid):
        wanted = needed_chunks(grid, index)
        assert len(set(wanted)) == len(wanted)
        # Only the chunks the grid names are handed over: a wrong name fails here.
        got = assemble(grid, index, {w: data[w] for w in wanted})
        assert len(got) == grid.chunk_nbytes
        lo, hi = chunk_region(grid, index)
        expect = np.zeros((*grid.chunk_shape, itemsize), np.uint8)
        part = tuple(slice(0, h - low) for low, h in zip(lo, hi, strict=True))
        expect[part] = tensor[tuple(slice(low, h) for low, h in zip(lo, hi, strict=True))]
        if grid.aligned:  # past the tensor an aligned chunk is padding, never read
            assert got[: _valid(grid, lo, hi)] == expect.tobytes()[: _valid(grid, lo, hi)]
        else:
            assert got == expect.tobytes()
        seen += math.prod(h - low for low, h in zip(lo, hi, strict=True))
    assert seen == math.prod(shape)


def _valid(grid, lo, hi) -> int:  # type: ignore[no-untyped-def]
    return math.prod(h - low for low, h in zip(lo, hi, strict=True)) * grid.itemsize


@settings(max_examples=200, deadline=None)
@given(tilings())
def test_needed_chunks_each_hold_a_byte_of_the_zarr_chunk(case) -> None:  # type: ignore[no-untyped-def]
    shape, itemsize, chunk_size, box_specs = case
    tensor = np.zeros((*shape, itemsize), np.uint8)
    boxes, _ = _store(tensor, box_specs, chunk_size)
    grid = choose_grid(shape, itemsize, chunk_size, boxes)
    for index in chunk_indices(grid):
        lo, hi = chunk_region(grid, index)
        for b, k in needed_chunks(grid, index):
            box = boxes[b]
            strides = strides_of(box.shape)
            olo = [max(a, o) - o for a, o in zip(lo, box.offsets, strict=True)]
            ohi = [min(a, o + s) - o for a, o, s in zip(hi, box.offsets, box.shape, strict=True)]
            offsets = set()
            for rel in np.ndindex(*[h - low for low, h in zip(olo, ohi, strict=True)]):
                at = sum((r + low) * s for r, low, s in zip(rel, olo, strides, strict=True))
                offsets.update(at * itemsize + j for j in range(itemsize))
            assert any(k * chunk_size <= off < (k + 1) * chunk_size for off in offsets)


def test_aligned_when_rows_divide_the_chunk_and_shards_start_on_chunks() -> None:
    boxes = [Box((0, 0), (64, 16), ("a",) * 4), Box((64, 0), (40, 16), ("b",) * 3)]
    grid = choose_grid((104, 16), 4, 1024, boxes)
    assert grid.aligned and grid.chunk_shape == (16, 16)
    assert needed_chunks(grid, (4,)) == [(1, 0)] and needed_chunks(grid, (6,)) == [(1, 2)]
    # A shard starting mid-chunk breaks the alignment: a general grid instead.
    odd = [Box((0, 0), (60, 16), ("a",) * 4), Box((60, 0), (44, 16), ("b",) * 3)]
    assert not choose_grid((104, 16), 4, 1024, odd).aligned
    # Rows wider than a chunk: parts of one row, about a chunk each.
    wide = choose_grid((3, 1000), 4, 1024, [Box((0, 0), (3, 1000), ("c",) * 12)])
    assert not wide.aligned and wide.chunk_shape == (1, 256)
