"""Restore geometry: which bytes of which stored chunk fill which part of a box.

Pure functions over shapes, offsets and sizes (no torch, no I/O), so property
tests can check them for any shapes, offsets, chunk sizes and world sizes.

A tensor of ``shape`` is stored in C order as ``nbytes = prod(shape) * itemsize``
bytes cut into chunks of ``chunk_size`` bytes at fixed offsets (the last one may
be shorter). A *box* is ``(offsets, shape)`` in a global tensor. A restore needs
one box of each global tensor; the stored entries' boxes tile the global tensor.
For each stored box that overlaps the needed one, ``slice_plan`` says which of
its chunks to fetch (only those holding bytes of the overlap), where they go in a
landing buffer, and how to view the overlap inside that buffer (element strides
and offset) and where it goes in the needed box. Chunk sizes need not be
multiples of the element size: the landing buffer starts at the element boundary
at or before the first fetched chunk, so element views stay aligned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ckptd.geometry import c_strides, covering_chunks

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, shape

def chunk_ranges(nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``nbytes`` bytes (one empty chunk for none,
    as ``ckptd.hashing.chunk_spans``)."""
    if nbytes == 0:
        return [(0, 0)]
    return [(a, min(a + chunk_size, nbytes)) for a in range(0, nbytes, chunk_size)]


def box_elements(box: Box) -> int:
    return math.prod(box[1])


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of one global tensor, or None when it holds no
    element. Two 0-dimensional boxes overlap in their one element."""
    (ao, ash), (bo, bsh) = a, b
    lo = tuple(max(x, y) for x, y in zip(ao, bo, strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(ao, ash, bo, bsh, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """How one stored entry fills its overlap with a needed box.

    Fetch ``chunks`` (indices into the entry's chunk list); chunk ``k`` with bytes
    ``[a, b)`` of the entry lands at ``[a - base, b - base)`` of a landing buffer of
    ``length`` bytes (``base`` and ``length`` are multiples of the item size). The
    overlap is then the view of that buffer, in elements, with ``shape``,
    ``strides`` and ``offset``; it goes to the part of the needed box that starts at
    ``dst_offsets`` (relative to the needed box) and has the same ``shape``."""

    chunks: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]  # [a, b) of each fetched chunk in the entry
    base: int
    length: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    dst_offsets: tuple[int, ...]

    def landing(self, k: int) -> tuple[int, int]:
        """Where the ``k``-th fetched chunk goes in the landing buffer."""
        a, b = self.spans[k]
        return a - self.base, b - self.base


def slice_plan(
    needed: Box, stored: Box, itemsize: int, chunk_size: int
) -> SlicePlan | None:
    """What stored box ``stored`` (its tensor cut into ``chunk_size`` chunks)
    contributes to the ``needed`` box, or None when they do not overlap."""
    both = overlap(needed, stored)
    if both is None:
        return None
    (lo, size), (so, ss) = both, stored
    rel_lo = [a - o for a, o in zip(lo, so, strict=True)]
    rel_hi = [a + n for a, n in zip(rel_lo, size, strict=True)]
    nbytes = math.prod(ss) * itemsize
    ks = covering_chunks(ss, itemsize, chunk_size, rel_lo, rel_hi)
    ranges = chunk_ranges(nbytes, chunk_size)
    spans = tuple(ranges[k] for k in ks)
    first_byte, end_byte = spans[0][0], spans[-1][1]
    base = first_byte // itemsize * itemsize
    length = -(-(end_byte - base) // itemsize) * itemsize
    strides = c_strides(ss)
    first = sum(r * s for r, s in zip(rel_lo, strides, strict=True))
    return SlicePlan(
        chunks=tuple(ks),
        spans=spans,
        base=base,
        length=length,
        shape=tuple(size),
        strides=strides,
        offset=first - base // itemsize,
        dst_offsets=tuple(a - o for a, o in zip(lo, needed[0], strict=True)),
    )


def fills(needed: Box, stored: Iterable[Box]) -> list[tuple[Box, Box]]:
    """Each distinct stored box that overlaps ``needed``, with the overlap, in the
    order given (replicas, the same box twice, count once)."""
    out = []
    seen: set[Box] = set()
    for box in stored:
        if box in seen:
            continue
        seen.add(box)
        both = overlap(needed, box)
        if both is not None:
            out.append((box, both))
    return out


__all__ = [
    "Box",
    "SlicePlan",
    "box_elements",
    "c_strides",
    "chunk_ranges",
    "covering_chunks",
    "fills",
    "overlap",
    "slice_plan",
]
