"""The restored tree back into a target state dict, in place.

``plan_fill`` and ``fill`` put a restored tree back into a target state dict in
place: tensors already there are overwritten with ``copy_`` (bitwise), missing
ones are created, containers are created as needed; a ``DTensor`` target's local
tensor is filled in place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import InvalidRequest, RestoreError
from ckptd.format import TensorEntry

from ..dtypes import path_str, torch_dtype
from ..sharding import check_target_layout, fill_dtensor, is_dtensor


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a restored tensor must look like: its dtype and (this rank's) shape,
    and, when known, where that box sits in the global tensor (a DTensor target
    must hold the same box)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None


def tensor_specs(entries: Iterable[TensorEntry]) -> dict[str, TensorSpec]:
    """The specs of a rank manifest's entries (dtype, box shape, global shape, offsets)."""
    return {
        e.name: TensorSpec(
            torch_dtype(e.dtype), tuple(e.shape), tuple(e.global_shape), tuple(e.offsets)
        )
        for e in entries
    }


def unflatten(tree: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    """A fresh state built from a tree and its tensors (no target to fill)."""
    return _build(tree, None, tensors, ())


def plan_fill(
    target: MutableMapping[Any, Any], tree: Mapping[str, Any], specs: Mapping[str, TensorSpec]
) -> None:
    """Checks, changing nothing, that ``fill`` can put ``tree`` into ``target``.

    Raises ``RestoreError`` naming every tensor the target holds with another dtype
    or shape than the checkpoint's (those cannot be filled in place)."""
    if not isinstance(target, MutableMapping):
        raise InvalidRequest(f"restore needs a mutable mapping, not {type(target).__name__}")
    if set(tree) != {"dict"}:
        raise RestoreError("the checkpoint's tree does not hold a dict at its root")
    bad: list[str] = []
    _plan(tree, target, specs, (), bad)
    if bad:
        raise RestoreError(
            f"{len(bad)} tensors in the target differ from the checkpoint in kind, dtype, "
            "shape or shard: "
            + "; ".join(bad[:10]),
            entries=bad[:50],
        )


def _plan(
    node: Mapping[str, Any],
    existing: Any,
    specs: Mapping[str, TensorSpec],
    path: tuple[str | int, ...],
    bad: list[str],
) -> None:
    ((kind, body),) = node.items()
    if kind == "bytes":
        return  # a blob replaces whatever the target holds
    if kind != "tensor" and isinstance(existing, torch.Tensor):  # (a DTensor too)
        # Filled in place, a target's tensor is the caller's; replaced by the
        # checkpoint's dict or list, it would silently stay as it was.
        held = {"dict": "a dict", "list": "a list", "tuple": "a tuple"}.get(kind, "a value")
        bad.append(f"{path_str(path)}: the target holds a tensor there, the checkpoint {held}")
        return
    if kind == "tensor":
        spec = specs[body]
        if is_dtensor(existing):
            local = existing.to_local()
            if local.dtype != spec.dtype or tuple(local.shape) != spec.shape:
                bad.append(
                    f"{body!r}: target DTensor's local shard {local.dtype}{list(local.shape)}, "
                    f"checkpoint {spec.dtype}{list(spec.shape)}"
                )
            else:
                why = check_target_layout(existing, body, spec.global_shape, spec.offsets)
                if why is not None:
                    bad.append(why)
        elif isinstance(existing, torch.Tensor) and (
            existing.dtype != spec.dtype or tuple(existing.shape) != spec.shape
        ):
            bad.append(
                f"{body!r}: target {existing.dtype}{list(existing.shape)}, "
                f"checkpoint {spec.dtype}{list(spec.shape)}"
            )
    elif kind == "dict" and isinstance(existing, Mapping):
        for key, child in body:
            if key in existing:
                _plan(child, existing[key], specs, (*path, key), bad)
    elif kind in ("list", "tuple") and isinstance(existing, Sequence) and not isinstance(
        existing, str
    ):
        for i, child in enumerate(body):
            if i < len(existing):
                _plan(child, existing[i], specs, (*path, i), bad)


def fill(
    target: MutableMapping[Any, Any], tree: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Puts the checkpoint's tree into ``target`` in place (call ``plan_fill`` first).

    A tensor the target already holds with the same dtype and shape is overwritten
    with ``copy_`` (so a model's parameters change in place); others are set to the
    restored tensor. Keys of the target that the checkpoint lacks are left alone."""
    with torch.no_grad():
        _build(tree, target, tensors, ())


def _build(
    node: Mapping[str, Any],
    existing: Any,
    tensors: Mapping[str, torch.Tensor],
    path: tuple[str | int, ...],
) -> Any:
    """The value of ``node``, reusing (and filling) ``existing`` where it fits."""
    ((kind, body),) = node.items()
    if kind == "value":
        return _as_member(existing, body)
    if kind == "float":
        return _as_member(existing, float(body))
    if kind == "bytes":
        data = tensors[body].contiguous().numpy().tobytes()
        if isinstance(existing, bytearray):  # kept and filled in place, as a tensor is,
            if len(existing) == len(data):  # when it fits; else a new one (a resize
                existing[:] = data  # would move memory that views of it still name)
                return existing
            return bytearray(data)
        return data
    if kind == "tensor":
        restored = tensors[body]
        if restored is existing:  # filled where it lies (its own memory, or on its device)
            return existing
        if is_dtensor(existing):  # never replaced by a plain tensor: filled in place
            fill_dtensor(existing, restored, body)
            return existing
        if (
            isinstance(existing, torch.Tensor)
            and existing.dtype == restored.dtype
            and existing.shape == restored.shape
        ):
            existing.copy_(restored)
            return existing
        return restored
    if kind == "dict":
        out = existing if isinstance(existing, MutableMapping) else {}
        for key, child in body:
            current = out.get(key) if key in out else None
            value = _build(child, current, tensors, (*path, key))
            if value is not current or key not in out:
                out[key] = value
        return out
    if kind == "list":
        if isinstance(existing, MutableSequence) and not isinstance(existing, str | bytearray):
            seq = existing
            if len(seq) > len(body):
                del seq[len(body) :]
            for i, child in enumerate(body):
                if i < len(seq):
                    value = _build(child, seq[i], tensors, (*path, i))
                    if value is not seq[i]:
                        seq[i] = value
                else:
                    seq.append(_build(child, None, tensors, (*path, i)))
            return seq
        return [_build(child, None, tensors, (*path, i)) for i, child in enumerate(body)]
    if kind == "tuple":
        old = existing if isinstance(existing, tuple) else ()
        return tuple(
            _build(child, old[i] if i < len(old) else None, tensors, (*path, i))
            for i, child in enumerate(body)
        )
    raise RestoreError(f"unknown tree node {kind!r} at {path_str(path)}")


def _as_member(existing: Any, value: Any) -> Any:
    """``value`` as the member of the target's enum that has it (an ``IntEnum`` the
    target holds stays one: the checkpoint holds its value, a plain int), or as it is.
    Only the target's own class is looked up, by value: nothing from the store names
    a class."""
    if isinstance(existing, enum.Enum) and type(value) in (int, str):
        try:
            return type(existing)(value)
        except (ValueError, TypeError):  # (not a value of it: the checkpoint's value wins)
            return value
    return value
