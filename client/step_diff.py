"""``ckptd diff``: what changed between two committed steps of a job.

Chunk ids say most of it without reading a byte: a tensor whose chunk ids are
the same in both steps did not change, and the count of shared ids says how much
of it stayed. With ``values``, the changed zarr chunks are read through the zarr
view (verified) one at a time, never a whole step, for the largest absolute and
relative difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import ml_dtypes
import numpy as np
import zarr
from zarr.core.sync import sync

from ckptd.zarr.grid import chunk_indices, chunk_region, needed_chunks
from ckptd.zarr.hierarchy import ArrayNode, shared_chunks

from .transport import Transport, open_transport
from .zarr_view import CheckpointStore

Status = Literal["same", "changed", "added", "removed", "retyped"]

# The dtypes a zarr view holds as raw bits (``ZARR_DTYPES``), by their real type.
_REAL = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
         "float8_e5m2": ml_dtypes.float8_e5m2, "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
         "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
         "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu}


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor's change between step A and step B."""

    path: str
    status: Status
    shared_chunks: int  # chunks of B whose id A's tensor also holds
    chunks: int  # chunks of B
    max_abs: float | None = None  # max |b - a| over the tensor (with values)
    max_rel: float | None = None  # max_abs / max |a|


def _ids(node: ArrayNode, index: tuple[int, ...]) -> list[str]:
    return [node.grid.boxes[b].chunks[k] for b, k in needed_chunks(node.grid, index)]


def _values(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float4_e2m1fn_x2":
        # Two fp4 values a byte: both nibbles, each one ml_dtypes' float4_e2m1fn (the
        # same unpacking of both steps, so whichever value torch puts first).
        arr = np.stack([arr & 0x0F, arr >> 4], axis=-1).view(ml_dtypes.float4_e2m1fn)
    real = _REAL.get(dtype)
    if real is not None:
        arr = arr.view(real)
    if arr.dtype.kind == "c":
        return arr.astype(np.complex128)
    return arr.astype(np.float64)


def _value_diff(a: ArrayNode, b: ArrayNode, za: zarr.Array[Any], zb: zarr.Array[Any]
                ) -> tuple[float, float]:
    """(max |b - a|, that over max |a|), zarr chunk by zarr chunk; chunks whose
    ckptd ids are the same in both are equal and not read."""
    same_grid = a.grid.chunk_shape == b.grid.chunk_shape
    max_abs = 0.0
    max_a = 0.0
    for index in chunk_indices(b.grid):
        if same_grid and _ids(a, index) == _ids(b, index):
            continue
        lo, hi = chunk_region(b.grid, index)
        where = tuple(slice(x, y) for x, y in zip(lo, hi, strict=True))
        va = _values(np.asarray(za[where]), a.dtype)
        vb = _values(np.asarray(zb[where]), b.dtype)
        if va.size:
            max_abs = max(max_abs, float(np.max(np.abs(vb - va))))
            max_a = max(max_a, float(np.max(np.abs(va))))
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, (max_abs / max_a if max_a else math.inf)


def diff_steps(
    url: str,
    job: str,
    step_a: int,
    step_b: int,
    *,
    token: str | None = None,
    values: bool = False,
    transport: Transport | None = None,
) -> list[TensorDiff]:
    """Every tensor of either step, with what changed from ``step_a`` to ``step_b``."""
    shared_transport = transport or open_transport(url, token, job=job, create=False)
    sa = CheckpointStore(url, job, step_a, token, transport=shared_transport)
    sb = CheckpointStore(url, job, step_b, token, transport=shared_transport)
    try:
        ha, hb = sync(sa.hierarchy()), sync(sb.hierarchy())
        ra = zarr.open_group(store=sa, mode="r")
        rb = zarr.open_group(store=sb, mode="r")
        out: list[TensorDiff] = []
        for path in sorted(set(ha.arrays) | set(hb.arrays)):
            a, b = ha.arrays.get(path), hb.arrays.get(path)
            if a is None or b is None:
                node = b if b is not None else a
                assert node is not None
                n = sum(len(box.chunks) for box in node.grid.boxes)
                out.append(TensorDiff(path, "added" if a is None else "removed", 0, n))
                continue
            shared, total = shared_chunks(a, b)
            if (a.dtype, a.grid.shape) != (b.dtype, b.grid.shape):
                out.append(TensorDiff(path, "retyped", shared, total))
                continue
            if shared == total and _layout(a) == _layout(b):
                out.append(TensorDiff(path, "same", shared, total,
                                      0.0 if values else None, 0.0 if values else None))
                continue
            diff = TensorDiff(path, "changed", shared, total)
            if values:
                za, zb = ra[path], rb[path]
                assert isinstance(za, zarr.Array) and isinstance(zb, zarr.Array)
                max_abs, max_rel = _value_diff(a, b, za, zb)
                diff = TensorDiff(path, "changed", shared, total, max_abs, max_rel)
            out.append(diff)
        return out
    finally:
        sa.close()
        sb.close()
        if transport is None:
            sync(shared_transport.close())


def _layout(node: ArrayNode) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    return sorted((box.offsets, box.chunks) for box in node.grid.boxes)
