"""Where a DTensor's local shard sits in its global tensor, from its placements.

A ``DTensor`` says how it is laid out (its device mesh and one placement per mesh
dimension), so its users need not describe the shard: the global shape is the
DTensor's shape, and the box this rank holds follows from the placements and the
rank's coordinate in the mesh. ``Shard(d)`` on any dimension (uneven splits too)
and ``Replicate()`` map onto the format's boxes; several mesh dimensions compose
(HSDP: ``Replicate`` on one, ``Shard(0)`` on the other gives sharded entries whose
identical boxes are replicas). ``Partial`` (unreduced sums) and ``_StridedShard``
(rows of a shard that are not one box) have no box and are refused.

torch.distributed is imported only when a DTensor exists: a process that never
made one does not pay for it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ckptd.errors import RestoreError, UnsupportedValue
from ckptd.format import Placement

Layout = tuple[Placement, list[int], list[int]]  # placement, global shape, offsets


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(value, dtensor)


def dtensor_layout(dt: torch.Tensor, where: str) -> Layout:
    """The format's placement, global shape and offsets of this rank's shard of
    ``dt``; ``UnsupportedValue`` (naming ``where``) for what has no box."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(dt.placements)  # type: ignore[attr-defined]
    for p in placements:
        if type(p) is not Shard and type(p) is not Replicate:
            hint = (
                " (an unreduced sum: redistribute it to Replicate() or Shard() first)"
                if p.is_partial()
                else ""
            )
            raise UnsupportedValue(
                f"DTensor at {where} has placement {p!r}{hint}; ckptd stores Shard(dim) and "
                "Replicate() placements",
                path=where,
                placement=repr(p),
            )
    mesh = dt.device_mesh  # type: ignore[attr-defined]
    if mesh.get_coordinate() is None:
        raise UnsupportedValue(
            f"DTensor at {where} lives on a device mesh this rank is not part of", path=where
        )
    global_shape = [int(d) for d in dt.shape]
    if all(type(p) is Replicate for p in placements):
        return "replicated", global_shape, [0] * len(global_shape)
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    local = dt.to_local()  # type: ignore[attr-defined]
    if tuple(int(d) for d in shape) != tuple(local.shape):
        raise UnsupportedValue(
            f"DTensor at {where}: its local tensor has shape {list(local.shape)}, its "
            f"placements {list(placements)} give {list(shape)}",
            path=where,
        )
    return "sharded", global_shape, [int(o) for o in offsets]


def local_tensor(dt: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``dt``, contiguous (no copy when it already is)."""
    return dt.to_local().contiguous()  # type: ignore[attr-defined, no-any-return]


def check_target_layout(
    dt: torch.Tensor,
    name: str,
    global_shape: tuple[int, ...] | None,
    offsets: tuple[int, ...] | None,
) -> str | None:
    """Why the checkpoint's box of ``name`` does not fit the DTensor target ``dt``,
    or None when it does (or when the checkpoint did not say where its box is)."""
    if global_shape is None or offsets is None:
        return None
    try:
        _, target_global, target_offsets = dtensor_layout(dt, repr(name))
    except UnsupportedValue as exc:
        return f"{name!r}: {exc}"
    if tuple(target_global) != tuple(global_shape) or tuple(target_offsets) != tuple(offsets):
        return (
            f"{name!r}: target DTensor holds the box at {target_offsets} of {target_global}, "
            f"checkpoint {list(offsets)} of {list(global_shape)}"
        )
    return None


def fill_dtensor(dt: torch.Tensor, restored: torch.Tensor, name: str) -> None:
    """Copies ``restored`` into ``dt``'s local shard in place."""
    local = dt.to_local()  # type: ignore[attr-defined]
    if local.dtype != restored.dtype or local.shape != restored.shape:
        raise RestoreError(
            f"{name!r}: target DTensor's local shard is {local.dtype}{list(local.shape)}, "
            f"checkpoint {restored.dtype}{list(restored.shape)}",
            entries=[name],
        )
    local.copy_(restored)
