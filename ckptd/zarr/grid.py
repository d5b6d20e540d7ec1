"""The zarr view's chunk grid: which bytes of which ckptd chunks make a zarr chunk.

Pure functions over shapes and byte offsets (no I/O, no zarr, no torch), so
hypothesis can check them. A global tensor is stored as one or more boxes (a
replicated entry is one box covering it, the distinct shards of a sharded one
tile it); each box's bytes are its C-order elements cut into ``chunk_size``
pieces at fixed offsets. See "zarr view" in docs/FORMAT.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ckptd.geometry import c_strides, covering_chunks


@dataclass(frozen=True, slots=True)
class Box:
    """One stored box of a global tensor: where it lies and its chunk ids."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: tuple[str, ...]

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.shape) * itemsize


@dataclass(frozen=True, slots=True)
class Grid:
    """A zarr array's regular chunk grid over the boxes of one global tensor.

    ``aligned``: zarr chunk ``i`` (along dim 0) is exactly one ckptd chunk, so it
    is served without a copy (the last one of a box padded to the full chunk)."""

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    itemsize: int
    chunk_size: int
    boxes: tuple[Box, ...]
    aligned: bool

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(
            -(-s // c) for s, c in zip(self.shape, self.chunk_shape, strict=True)
        )

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a zarr chunk filled from one box.

    The box's chunks ``first ..`` (only those in ``needed`` are read) laid end to
    end hold, from byte ``offset`` with element ``strides``, the sub-box of
    ``shape`` that goes at ``dest`` (start index per dimension) of the zarr chunk."""

    box: int
    first: int
    needed: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]
    shape: tuple[int, ...]
    dest: tuple[int, ...]


def strides_of(shape: Sequence[int]) -> list[int]:
    """C-order strides in elements."""
    return list(c_strides(shape))


def choose_grid(
    shape: Sequence[int], itemsize: int, chunk_size: int, boxes: Sequence[Box]
) -> Grid:
    """The grid of a global tensor: aligned with the ckptd chunks where it can be.

    Aligned when every box spans whole rows of dim 0, a row's bytes divide
    ``chunk_size``, and every box starts (and, but for the last, ends) on a
    multiple of the rows per chunk. Otherwise about ``chunk_size`` bytes per zarr
    chunk: trailing dimensions whole while they fit, then a part of one."""
    shape_t = tuple(shape)
    boxes_t = tuple(boxes)
    if not shape_t:
        one = all(len(b.chunks) <= 1 for b in boxes_t)
        return Grid(shape_t, (), itemsize, chunk_size, boxes_t, aligned=one)
    row = math.prod(shape_t[1:]) * itemsize
    if row and chunk_size % row == 0 and all(s for s in shape_t):
        per = chunk_size // row
        ok = all(
            tuple(b.offsets[1:]) == (0,) * (len(shape_t) - 1)
            and tuple(b.shape[1:]) == shape_t[1:]
            and b.offsets[0] % per == 0
            and (b.shape[0] % per == 0 or b.offsets[0] + b.shape[0] == shape_t[0])
            for b in boxes_t
        )
        if ok:
            chunk = (per, *shape_t[1:])
            return Grid(shape_t, chunk, itemsize, chunk_size, boxes_t, aligned=True)
    chunk_l = [1] * len(shape_t)
    elements = max(1, chunk_size // itemsize)
    for d in range(len(shape_t) - 1, -1, -1):
        extent = max(1, shape_t[d])
        if extent <= elements:
            chunk_l[d] = extent
            elements //= extent
        else:
            chunk_l[d] = _fit_boundaries(max(1, elements), d, shape_t[d], boxes_t)
            break
    return Grid(shape_t, tuple(chunk_l), itemsize, chunk_size, boxes_t, aligned=False)


def _fit_boundaries(extent: int, d: int, size: int, boxes: Sequence[Box]) -> int:
    """A chunk extent along ``d`` that the boxes' edges fall on, so a zarr chunk
    reads one shard, unless that would shrink it below a quarter."""
    edges = {b.offsets[d] for b in boxes} | {b.offsets[d] + b.shape[d] for b in boxes}
    g = math.gcd(*(e for e in edges if 0 < e < size))
    if g == 0 or g % extent == 0:
        return extent
    divisors = {x for i in range(1, math.isqrt(g) + 1) if g % i == 0 for x in (i, g // i)}
    best = max(c for c in divisors if c <= extent)
    return best if 4 * best >= extent else extent


def chunk_region(grid: Grid, index: Sequence[int]) -> tuple[list[int], list[int]]:
    """The global ``[lo, hi)`` a zarr chunk covers, clipped to the tensor."""
    lo = [i * c for i, c in zip(index, grid.chunk_shape, strict=True)]
    hi = [min(a + c, s) for a, c, s in zip(lo, grid.chunk_shape, grid.shape, strict=True)]
    return lo, hi


def chunk_pieces(grid: Grid, index: Sequence[int]) -> list[Piece]:
    """What fills zarr chunk ``index``: one piece per box it overlaps."""
    lo, hi = chunk_region(grid, index)
    pieces: list[Piece] = []
    for b, box in enumerate(grid.boxes):
        olo = [max(a, o) for a, o in zip(lo, box.offsets, strict=True)]
        ohi = [min(a, o + s) for a, o, s in zip(hi, box.offsets, box.shape, strict=True)]
        if any(h <= low for low, h in zip(olo, ohi, strict=True)):
            continue
        rel_lo = [a - o for a, o in zip(olo, box.offsets, strict=True)]
        rel_hi = [a - o for a, o in zip(ohi, box.offsets, strict=True)]
        needed = covering_chunks(box.shape, grid.itemsize, grid.chunk_size, rel_lo, rel_hi)
        strides = strides_of(box.shape)
        start = sum(r * s for r, s in zip(rel_lo, strides, strict=True))
        first = needed[0]
        pieces.append(
            Piece(
                box=b,
                first=first,
                needed=tuple(needed),
                offset=start * grid.itemsize - first * grid.chunk_size,
                strides=tuple(strides),
                shape=tuple(h - a for a, h in zip(olo, ohi, strict=True)),
                dest=tuple(a - c for a, c in zip(olo, lo, strict=True)),
            )
        )
    return pieces


def aligned_chunk(grid: Grid, index: Sequence[int]) -> tuple[int, int] | None:
    """(box, chunk index) of the one ckptd chunk that is zarr chunk ``index`` of an
    aligned grid; None past the data."""
    if not grid.aligned:
        raise ValueError("not an aligned grid")
    if not grid.shape:
        return (0, 0) if grid.boxes and grid.boxes[0].chunks else None
    row0 = index[0] * grid.chunk_shape[0]
    for b, box in enumerate(grid.boxes):
        if box.offsets[0] <= row0 < box.offsets[0] + box.shape[0]:
            k = (row0 - box.offsets[0]) // grid.chunk_shape[0]
            return (b, k) if k < len(box.chunks) else None
    return None


def chunk_indices(grid: Grid) -> itertools.product[tuple[int, ...]]:
    """Every zarr chunk index of the grid, in C order."""
    return itertools.product(*(range(n) for n in grid.counts))


def needed_chunks(grid: Grid, index: Sequence[int]) -> list[tuple[int, int]]:
    """(box, chunk index) of every ckptd chunk that zarr chunk ``index`` reads."""
    if grid.aligned:
        hit = aligned_chunk(grid, index)
        return [] if hit is None else [hit]
    return [(p.box, k) for p in chunk_pieces(grid, index) for k in p.needed]


def assemble(grid: Grid, index: Sequence[int], data: Mapping[tuple[int, int], bytes]) -> bytes:
    """The bytes of zarr chunk ``index`` (its full chunk shape, C order, zeros past
    the tensor) from the ckptd chunks ``needed_chunks`` named, by (box, index)."""
    if grid.aligned:
        hit = aligned_chunk(grid, index)
        if hit is None:
            return bytes(grid.chunk_nbytes)
        raw = data[hit]
        return raw if len(raw) == grid.chunk_nbytes else raw + bytes(grid.chunk_nbytes - len(raw))
    isz = grid.itemsize
    out = np.zeros((*grid.chunk_shape, isz), dtype=np.uint8)
    for piece in chunk_pieces(grid, index):
        last = data[(piece.box, piece.needed[-1])]
        buf = np.zeros((piece.needed[-1] - piece.first) * grid.chunk_size + len(last), np.uint8)
        for k in piece.needed:
            at = (k - piece.first) * grid.chunk_size
            raw = data[(piece.box, k)]
            buf[at : at + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        src = np.lib.stride_tricks.as_strided(
            buf[piece.offset :],
            shape=(*piece.shape, isz),
            strides=(*(s * isz for s in piece.strides), 1),
            writeable=False,
        )
        out[tuple(slice(d, d + n) for d, n in zip(piece.dest, piece.shape, strict=True))] = src
    return out.tobytes()
