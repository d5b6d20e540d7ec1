"""Where each tensor of a save sits in the pool (whole, or split at chunk
boundaries into pieces under a budget), the staged pieces, and the copies into
them."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import cuda
from .segments import _Segment

if TYPE_CHECKING:
    from .pool import StagingPool

PAGE = 4096


SMALL_ALIGN = 64


PAGE_ALIGN_FROM = 64 * 1024  # tensors this large start on a page


SEGMENT_GRAIN = 2 * 1024 * 1024  # unbudgeted segments are rounded up to this


_BOUNCE = 16 * 1024 * 1024  # bytes of a non-contiguous tensor gathered at once


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _alignment(nbytes: int) -> int:
    return PAGE if nbytes >= PAGE_ALIGN_FROM else SMALL_ALIGN


def _footprint(nbytes: int) -> int:
    return _align(nbytes, _alignment(nbytes))


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What the manifest needs of one tensor of a save."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class StagedSpan:
    """Bytes ``[start, end)`` of one tensor's C-order bytes, staged in the pool.

    ``start`` is a multiple of the chunk size, so the span's chunks are the
    tensor's chunks ``start // chunk_size`` onwards. ``data`` is a zero-copy view
    of the pool: valid until the next stage."""

    index: int  # into the save's tensor list
    start: int
    end: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class _Placed:
    """One span's place in the pool."""

    index: int
    start: int
    end: int
    segment: int
    offset: int


@dataclass(slots=True)
class _Layout:
    key: tuple[int, list[TensorInfo]]  # (chunk size, the tensors it places)
    pieces: list[list[_Placed]]
    ident: int = field(default_factory=lambda: secrets.randbits(48))  # names its caches


@dataclass(slots=True)
class StagePlan:
    """What one save stages: its tensors and the layout of each piece."""

    infos: list[TensorInfo]
    sources: list[torch.Tensor]
    layout: _Layout
    chunk_size: int
    devices: list[torch.device]  # CUDA devices among the sources

    @property
    def piece_count(self) -> int:
        return len(self.layout.pieces)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos)


class StagedPiece:
    """One staged piece of a save (the whole state unless a budget split it).

    ``wait_copied`` blocks until the copies are complete (at once on the CPU; on a
    GPU it waits for the copy-done event and closes the seqlock write); ``publish``
    records the spans' chunk ids in the pool's index. Both are called by the
    pipeline, off the training thread."""

    def __init__(
        self,
        pool: StagingPool,
        number: int,
        count: int,
        spans: list[StagedSpan],
        placed: list[_Placed],
        generation: int,
        seconds: float,
        copy_done: cuda.CopyDone | None,
        step: int | None,
    ) -> None:
        self._pool = pool
        self.number = number
        self.count = count
        self.spans = spans
        self._placed = placed
        self.generation = generation
        self.seconds = seconds
        self.copy_done = copy_done
        self.step = step
        self.copied = copy_done is None

    @property
    def last(self) -> bool:
        return self.number == self.count - 1

    @property
    def nbytes(self) -> int:
        return sum(s.end - s.start for s in self.spans)

    def wait_copied(self) -> None:
        if self.copied:
            return
        assert self.copy_done is not None
        self.copy_done.synchronize()
        self._pool._end_write(self.generation)
        self.copied = True

    def publish(self, chunk_ids: Sequence[Sequence[str]]) -> None:
        self._pool._publish(self, chunk_ids)


def _pack_sequential(
    order: Sequence[int], infos: Sequence[TensorInfo], seg: _Segment, segments: list[_Segment]
) -> list[_Placed]:
    out = []
    cursor = 0
    index = segments.index(seg)
    for i in order:
        n = infos[i].nbytes
        off = _align(cursor, _alignment(n))
        out.append(_Placed(i, 0, n, index, off))
        cursor = off + n
    assert cursor <= seg.nbytes, "segment too small for its tensors"
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, p: _Placed, plan: StagePlan,
          non_blocking: bool) -> None:
    src = src.detach()
    if p.start == 0 and p.end == plan.infos[p.index].nbytes:
        dst.copy_(src, non_blocking=non_blocking)
    else:
        _copy_bytes(dst, src, p.start, p.end, non_blocking)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, a: int, b: int, non_blocking: bool) -> None:
    """``dst`` (uint8) = bytes ``[a, b)`` of ``src`` in C order, for any strides.

    A split may fall inside a row or an element (chunk sizes need not be multiples
    of either): contiguous sources are sliced as bytes; others are gathered a
    block of rows at a time (at most ``_BOUNCE`` bytes), recursing into a row that
    alone is larger."""
    if b <= a:
        return
    if src.is_contiguous():
        flat = src.reshape(-1)
        if flat.is_conj() or flat.is_neg():
            # A conjugate or negated view has no bytes of its own to view (copy_ to
            # a typed tensor resolves it): resolve only the elements [a, b) covers.
            size = src.element_size()
            first = a // size
            flat = flat[first : -(-b // size)].resolve_conj().resolve_neg()
            a, b = a - first * size, b - first * size
        dst.copy_(flat.view(torch.uint8)[a:b], non_blocking=non_blocking)
        return
    row = (src[0].numel() if src.shape[0] else 0) * src.element_size()
    pos = a
    while pos < b:
        r = pos // row
        if row > _BOUNCE:
            hi = min(b, (r + 1) * row)
            _copy_bytes(dst[pos - a : hi - a], src[r], pos - r * row, hi - r * row, non_blocking)
        else:
            r2 = min(src.shape[0], r + max(1, _BOUNCE // row), math.ceil(b / row))
            block = src[r:r2].contiguous().resolve_conj().resolve_neg()
            hi = min(b, r2 * row)
            flat = block.reshape(-1).view(torch.uint8)
            dst[pos - a : hi - a].copy_(flat[pos - r * row : hi - r * row],
                                        non_blocking=non_blocking)
        pos = hi
