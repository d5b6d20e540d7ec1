"""Which chunks of a C-order tensor hold a sub-box: the one piece of geometry that
restore (``ckptd.client.restore.geometry``) and the zarr view (``ckptd.zarr.grid``)
share. Pure functions over shapes and sizes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

# Past this many separate runs, covering_chunks takes the whole byte range between
# the first and the last needed byte instead of walking every run.
MAX_RUNS = 100_000


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-order tensor of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def covering_chunks(
    shape: Sequence[int], itemsize: int, chunk_size: int, lo: Sequence[int], hi: Sequence[int]
) -> list[int]:
    """Indices, ascending, of the chunks of a C-order tensor of ``shape`` that hold
    a byte of the elements of the sub-box ``[lo, hi)`` (relative to the tensor)."""
    n = len(shape)
    if n == 0:  # one element, which may span chunks smaller than itself
        return list(range((itemsize - 1) // chunk_size + 1))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return []
    strides = c_strides(shape)
    # The innermost dimensions the sub-box spans whole form one contiguous run.
    k = n - 1
    while k > 0 and lo[k] == 0 and hi[k] == shape[k]:
        k -= 1
    run = (hi[k] - lo[k]) * strides[k] * itemsize
    runs = math.prod(hi[d] - lo[d] for d in range(k))
    first = sum(lo[d] * strides[d] for d in range(n)) * itemsize
    last = (sum((hi[d] - 1) * strides[d] for d in range(n)) + 1) * itemsize
    if runs > MAX_RUNS or run >= last - first:
        return list(range(first // chunk_size, (last - 1) // chunk_size + 1))
    chunks: set[int] = set()
    for idx in itertools.product(*(range(lo[d], hi[d]) for d in range(k))):
        start = sum(i * s for i, s in zip(idx, strides, strict=False)) + lo[k] * strides[k]
        start *= itemsize
        chunks.update(range(start // chunk_size, (start + run - 1) // chunk_size + 1))
    return sorted(chunks)
