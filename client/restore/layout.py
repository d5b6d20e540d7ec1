"""What the target needs: the box of each global tensor it wants, where each
tensor is assembled (its own memory when it fits), and the chunks that fill it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import InvalidRequest, RestoreError
from ckptd.format import TensorEntry
from ckptd.hashing import chunk_spans

from ..dtypes import byte_view, torch_dtype
from ..sharding import dtensor_layout, is_dtensor
from .devices import LANES
from .fetch import WantedChunks
from .fill import TensorSpec
from .geometry import Box, slice_plan
from .memory import fresh_tensor
from .plan import RestorePlan


def fill_from_entry(wanted: WantedChunks, name: str, buf: torch.Tensor, box: Box,
                     e: TensorEntry, chunk_size: int, in_target: bool) -> int:
    """Plans filling the part of ``buf`` (the needed ``box``; the target's own
    tensor when ``in_target``) that stored entry ``e`` overlaps; the number of
    elements it covers."""
    (bo, bs), eo, es = box, tuple(e.offsets), tuple(e.shape)
    if (bo, bs) == (eo, es):
        view = byte_view(buf)
        if len(e.chunks) == 1 and 0 < e.nbytes <= chunk_size:
            # (most tensors of a state are one chunk: no span generator for them)
            wanted.add(e.chunks[0], view[:e.nbytes], name, in_target)
            return math.prod(bs)
        for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, chunk_size), strict=True):
            wanted.add(cid, view[a:b], name, in_target)
        return math.prod(bs)
    itemsize = buf.element_size()
    plan = slice_plan(box, (eo, es), itemsize, chunk_size)
    if plan is None:
        return 0
    wanted.elastic = True
    flat = fresh_tensor((plan.length // itemsize,), buf.dtype)
    fview = byte_view(flat)
    for k, index in enumerate(plan.chunks):
        a, b = plan.landing(k)
        wanted.add(e.chunks[index], fview[a:b], name)
    src = flat.as_strided(plan.shape, plan.strides, plan.offset)
    dst = buf[tuple(slice(o, o + n) for o, n in zip(plan.dst_offsets, plan.shape, strict=True))]
    wanted.copies.append((dst, src))
    return math.prod(plan.shape)


def _target_values(tree: Mapping[str, Any], target: Any) -> dict[str, Any]:
    """Tensor name -> what the target holds at that place of the tree (or None)."""
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], existing: Any) -> None:
        ((kind, body),) = node.items()
        if kind == "tensor":
            out[body] = existing
        elif kind == "bytes":
            out[body] = None  # a blob is rebuilt, never filled in place
        elif kind == "dict":
            for key, child in body:
                ok = isinstance(existing, Mapping) and key in existing
                walk(child, existing[key] if ok else None)
        elif kind in ("list", "tuple"):
            seq = existing if isinstance(existing, Sequence) and not isinstance(
                existing, str | bytes) else ()
            for i, child in enumerate(body):
                walk(child, seq[i] if i < len(seq) else None)

    walk(tree, target)
    return out


def _shape_of(value: Any) -> tuple[int, ...] | None:
    if is_dtensor(value):
        return tuple(int(d) for d in value.to_local().shape)
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    return None


def needed_box(
    e: TensorEntry,
    existing: Any,
    shard: Any | None,
    same_world: bool,
) -> Box:
    """The box of global tensor ``e.name`` that the target needs (see the module
    docstring). ``e`` is the entry of the manifest whose tree is restored."""
    own: Box = (tuple(e.offsets), tuple(e.shape))
    g = tuple(e.global_shape)
    whole: Box = ((0,) * len(g), g)
    if e.placement == "local":
        return own
    if shard is not None:
        if not (hasattr(shard, "global_shape") and hasattr(shard, "offsets")):
            raise InvalidRequest(f"shards[{e.name!r}] is a {type(shard).__name__}: pass "
                                 "Shard(global_shape, offsets)", name=e.name)
        sg, so = tuple(shard.global_shape), tuple(shard.offsets)
        if sg != g:
            raise RestoreError(f"{e.name!r}: the Shard says global shape {list(sg)}, the "
                               f"checkpoint {list(g)}", entries=[e.name])
        shape = _shape_of(existing)
        if shape is None:
            raise RestoreError(f"{e.name!r} has a Shard but the target holds no tensor there, "
                               "so the shard's shape is unknown", entries=[e.name])
        box: Box = (so, shape)
    elif is_dtensor(existing):
        _, dg, do = dtensor_layout(existing, repr(e.name))
        if tuple(dg) != g:
            raise RestoreError(f"{e.name!r}: the target DTensor's global shape is {dg}, the "
                               f"checkpoint's {list(g)}", entries=[e.name])
        box = (tuple(do), _shape_of(existing) or ())
    elif isinstance(existing, torch.Tensor):
        shape = tuple(int(d) for d in existing.shape)
        if shape == own[1] and (same_world or e.placement == "replicated"):
            return own
        if shape == g:
            return whole
        if same_world or e.placement == "replicated":
            return own  # the shapes differ: plan_fill names it
        raise RestoreError(
            f"{e.name!r}: the checkpoint holds shards of a {list(g)} tensor saved by another "
            f"world size and the target holds a {list(shape)} tensor; pass its Shard (or use "
            "a DTensor) so the restore knows which box it needs",
            entries=[e.name],
        )
    else:
        return own if same_world else whole
    if len(box[0]) != len(g) or len(box[1]) != len(g) or any(
        o < 0 or o + s > d for o, s, d in zip(box[0], box[1], g, strict=True)
    ):
        raise RestoreError(f"{e.name!r}: box {list(box[1])} at {list(box[0])} does not fit "
                           f"global shape {list(g)}", entries=[e.name])
    return box


@dataclass(slots=True)
class RestoreLayout:
    """The tree to restore, the spec and assembly buffer of each tensor, and the
    chunks to fetch into those buffers."""

    tree: dict[str, Any]
    specs: dict[str, TensorSpec]
    buffers: dict[str, torch.Tensor]
    wanted: WantedChunks
    entries: list[tuple[TensorEntry, int]]  # every stored entry read from (for the pool)


def needed_boxes(
    plan: RestorePlan,
    target: Any,
    shards: Mapping[str, Any],
    world_size: int,
) -> tuple[dict[str, Box], bool]:
    """The box each tensor of the plan's tree needs; and whether some box is not an
    entry of the plan's manifest (so every rank's manifest must be read)."""
    same_world = world_size == plan.world_size and plan.rank < world_size
    values = _target_values(plan.manifest.tree, target)
    boxes: dict[str, Box] = {}
    other = False
    for e in plan.manifest.entries:
        # A name this rank holds several shards of (format 1.3) is one tensor whose
        # box no single entry gives: needed as from another world size.
        # An item another rank saved (``plan.elsewhere``): none of this rank's boxes.
        again = e.name in boxes or e.name in plan.elsewhere
        box = needed_box(e, values.get(e.name), shards.get(e.name), same_world and not again)
        boxes[e.name] = box
        other = other or box != (tuple(e.offsets), tuple(e.shape))
    return boxes, other


def _holds_entry_bytes(existing: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """A dense, contiguous tensor of the right dtype and shape: its bytes are the
    entry's bytes, wherever it lives."""
    return (
        isinstance(existing, torch.Tensor)
        and not is_dtensor(existing)
        and existing.layout == torch.strided
        and existing.dtype == dtype
        and tuple(existing.shape) == shape
        and existing.is_contiguous()
        and not existing.is_conj()
        and not existing.is_neg()
        and existing.numel() > 0
    )


def fits_in_place(existing: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether the restore may assemble straight into the target's tensor (once
    every chunk verified): one on the host that holds the entry's bytes."""
    return _holds_entry_bytes(existing, dtype, shape) and existing.device.type == "cpu"


def _on_device(existing: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether the restore may copy chunks straight into this device tensor (once
    every chunk verified): one off the host that holds the entry's bytes."""
    kind = existing.device.type
    return (kind not in ("cpu", "meta") or kind in LANES) and _holds_entry_bytes(
        existing, dtype, shape)


def build_layout(
    plan: RestorePlan, boxes: Mapping[str, Box], values: Mapping[str, Any] | None = None
) -> RestoreLayout:
    """Where every tensor of the plan's tree is assembled (the target's own tensor
    when it fits, else fresh memory) and the chunks (of the plan's manifests) that
    fill it."""
    manifest = plan.manifest
    cs = manifest.chunk_size
    values = values or {}
    wanted = WantedChunks()
    specs: dict[str, TensorSpec] = {}
    buffers: dict[str, torch.Tensor] = {}
    used: dict[tuple[str, int], tuple[TensorEntry, int]] = {}
    # Stored boxes of every global tensor across the manifests read, one per box;
    # this rank's own manifest first (its pool holds those chunks).
    order = [plan.rank] + sorted(r for r in plan.manifests if r != plan.rank)
    stored: dict[str, dict[Box, tuple[TensorEntry, int]]] = {}
    for r in order:
        m = plan.manifests[r]
        for e in m.entries:
            if e.placement == "local":
                continue
            stored.setdefault(e.name, {}).setdefault(
                (tuple(e.offsets), tuple(e.shape)), (e, m.chunk_size))
    for e in manifest.entries:
        if e.name in specs:
            continue  # another shard of a tensor planned already (its boxes are in stored)
        box = boxes[e.name]
        dtype = torch_dtype(e.dtype)
        existing = values.get(e.name)
        specs[e.name] = TensorSpec(dtype, box[1], tuple(e.global_shape), box[0])
        own_box = e.placement == "local" or box == (tuple(e.offsets), tuple(e.shape))
        if own_box and isinstance(existing, torch.Tensor) and _on_device(existing, dtype, box[1]):
            # Straight from the verified host bytes into the device tensor: no
            # host buffer in between, no second copy (see ``devices.to_devices``).
            flat = existing.detach().reshape(-1).view(torch.uint8)
            for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, cs), strict=True):
                wanted.add_device(cid, flat[a:b], e.name)
            buffers[e.name] = existing
            used[(e.name, id(e))] = (e, cs)
            continue
        in_target = fits_in_place(existing, dtype, box[1])
        buf = existing if in_target and isinstance(existing, torch.Tensor) else fresh_tensor(
            box[1], dtype)
        buffers[e.name] = buf
        if own_box:
            fill_from_entry(wanted, e.name, buf, box, e, cs, in_target)
            used[(e.name, id(e))] = (e, cs)
            continue
        covered = 0
        for (se, scs) in stored.get(e.name, {}).values():
            if se.dtype != e.dtype or tuple(se.global_shape) != tuple(e.global_shape):
                raise RestoreError(f"{e.name!r}: ranks disagree on its dtype or global shape",
                                   entries=[e.name])
            n = fill_from_entry(wanted, e.name, buf, box, se, scs, in_target)
            if n:
                covered += n
                used[(se.name, id(se))] = (se, scs)
        if covered != math.prod(box[1]):
            raise RestoreError(
                f"{e.name!r}: the stored shards cover {covered} of the {math.prod(box[1])} "
                f"elements of the box {list(box[1])} at {list(box[0])}",
                entries=[e.name],
            )
    return RestoreLayout(manifest.tree, specs, buffers, wanted, list(used.values()))
