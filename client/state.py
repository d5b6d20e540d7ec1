"""State dicts as the manifest's tree skeleton plus named tensors, and back.

``flatten`` turns what ``model.state_dict()``, ``optimizer.state_dict()``, LR
schedulers and plain Python produce into the format's tree (see
``ckptd.format.check_tree``) and a list of tensors named by their keys joined with
".". Nothing is pickled: a leaf the tree cannot hold is refused with its path.
``plan_fill`` and ``fill`` put a restored tree back into a target state dict in
place: tensors already there are overwritten with ``copy_`` (bitwise), missing
ones are created, containers are created as needed.

A ``DTensor`` leaf is stored as its local shard: ``flatten`` puts ``to_local()`` in
``FlatState.tensors`` and the shard's placement, global shape and offsets (from
the DTensor's placements, see ``ckptd.client.sharding``) in ``FlatState.layouts``;
``fill`` copies a restored shard into a DTensor target's local tensor in place.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import InvalidRequest, RestoreError, UnsupportedValue
from ckptd.format import MAX_NAME_LEN, MAX_TREE_DEPTH, Placement, TensorEntry

from .sharding import check_target_layout, dtensor_layout, fill_dtensor, is_dtensor, local_tensor

# torch dtype <-> the format's stable dtype names (ckptd.dtypes.ITEMSIZE).
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _attr, _name in (
    ("uint16", "uint16"),
    ("uint32", "uint32"),
    ("uint64", "uint64"),
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAMES.items()}

if sys.byteorder != "little":  # the format's bytes are little-endian; torch's are native
    raise ImportError("ckptd.client needs a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name of a torch dtype; ``UnsupportedValue`` if it has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedValue(f"tensors of dtype {dtype} cannot be checkpointed") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a format dtype name."""
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise RestoreError(f"dtype {name!r} has no torch equivalent here", dtype=name) from None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, writable, without a copy.

    blake3 refuses bf16 numpy arrays and non-contiguous buffers; a flat uint8 view
    of a contiguous tensor works for every dtype (0-dim tensors included)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise InvalidRequest("byte_view needs a contiguous CPU tensor")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def path_str(path: Sequence[str | int]) -> str:
    """A readable path into a state dict: ``state['optim']['state'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def _tensor_name(path: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in path)


@dataclass(frozen=True, slots=True)
class FlatState:
    """A state dict split into its tree skeleton and its named tensors (in order).

    ``layouts`` holds (placement, global shape, offsets) for every tensor that was a
    DTensor; ``tensors`` holds that DTensor's local shard (contiguous)."""

    tree: dict[str, Any]
    tensors: list[tuple[str, torch.Tensor]]
    layouts: dict[str, tuple[Placement, list[int], list[int]]] = field(default_factory=dict)
    # Tensors of Stateful objects that say they are rank-private (``rank_local``,
    # e.g. ``RNGState``): saved ``local`` unless the caller says otherwise.
    local: set[str] = field(default_factory=set)


def is_stateful(value: Any) -> bool:
    """True for DCP's ``Stateful`` protocol: an object (not a mapping or a tensor)
    with ``state_dict()`` and ``load_state_dict()``, like a module, an optimizer,
    an LR scheduler or ``RNGState``."""
    return (
        not isinstance(value, Mapping | torch.Tensor | type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def flatten(state: Mapping[Any, Any]) -> FlatState:
    """Splits a nested state dict into the format's tree and its named tensors.

    Raises ``UnsupportedValue`` (naming the path) for anything that is not a dict
    with str or int keys, a list, a tuple, a tensor, None, bool, int, float or str,
    and for two tensors whose dotted names collide."""
    if not isinstance(state, Mapping):
        raise UnsupportedValue(f"a state must be a mapping, not {type(state).__name__}")
    tensors: list[tuple[str, torch.Tensor]] = []
    where: dict[str, tuple[str | int, ...]] = {}
    layouts: dict[str, tuple[Placement, list[int], list[int]]] = {}
    local: set[str] = set()
    tree = _flatten_node(state, (), tensors, where, layouts, local)
    return FlatState(tree=tree, tensors=tensors, layouts=layouts, local=local)


def value_tree(value: Any, where: str) -> dict[str, Any]:
    """The tree node of a plain value (no tensors): what ``flatten`` makes of it.

    ``unflatten(node, {})`` gives the value back. Raises ``UnsupportedValue``
    (naming ``where``) for anything the tree cannot hold, tensors included."""
    tensors: list[tuple[str, torch.Tensor]] = []
    node = _flatten_node(value, (where,), tensors, {}, {})
    if tensors:
        raise UnsupportedValue(
            f"{path_str((where,))} holds tensors inside a plain value", path=path_str((where,))
        )
    return node


def _flatten_node(
    value: Any,
    path: tuple[str | int, ...],
    tensors: list[tuple[str, torch.Tensor]],
    where: dict[str, tuple[str | int, ...]],
    layouts: dict[str, tuple[Placement, list[int], list[int]]],
    local: set[str] | None = None,
) -> dict[str, Any]:
    if len(path) > MAX_TREE_DEPTH:  # the same bound as ckptd.format.check_tree
        raise UnsupportedValue(
            f"{path_str(path)} is nested deeper than {MAX_TREE_DEPTH} levels", path=path_str(path)
        )
    if is_dtensor(value):
        # The layout first: a Partial placement is refused before any copy.
        layout = dtensor_layout(value, path_str(path))
        name = _add_tensor(local_tensor(value), path, tensors, where)
        layouts[name] = layout
        return {"tensor": name}
    if isinstance(value, torch.Tensor):
        return {"tensor": _add_tensor(value, path, tensors, where)}
    if isinstance(value, bytes | bytearray | memoryview):
        return _bytes_node(value, path, tensors, where)
    if is_stateful(value):  # a module, optimizer, scheduler, RNGState: its state_dict()
        first = len(tensors)
        node = _flatten_node(value.state_dict(), path, tensors, where, layouts, local)
        if getattr(value, "rank_local", False) and local is not None:
            local.update(name for name, _ in tensors[first:])
        return node
    if value is None or isinstance(value, bool):
        return {"value": value if value is None else bool(value)}
    if isinstance(value, int):
        return {"value": int(value)}
    if isinstance(value, float):
        f = float(value)
        if math.isnan(f):
            return {"float": "nan"}
        if math.isinf(f):
            return {"float": "inf" if f > 0 else "-inf"}
        return {"value": f}
    if isinstance(value, str):
        s = str.__str__(value)
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedValue(
                f"{path_str(path)} is a string that is not valid UTF-8", path=path_str(path)
            ) from None
        return {"value": s}
    if isinstance(value, Mapping):
        items: list[list[Any]] = []
        for key, child in value.items():
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise UnsupportedValue(
                    f"{path_str(path)} has a key {key!r} of type {type(key).__name__}; "
                    "only str and int keys can be checkpointed",
                    path=path_str(path),
                )
            key = str.__str__(key) if isinstance(key, str) else int(key)
            items.append(
                [key, _flatten_node(child, (*path, key), tensors, where, layouts, local)]
            )
        return {"dict": items}
    if type(value) is list or type(value) is tuple or type(value) is torch.Size:
        kind = "list" if type(value) is list else "tuple"
        return {
            kind: [
                _flatten_node(c, (*path, i), tensors, where, layouts, local)
                for i, c in enumerate(value)
            ]
        }
    raise UnsupportedValue(
        f"{path_str(path)} holds a {type(value).__module__}.{type(value).__qualname__}, "
        "which ckptd cannot store without pickling (supported: dict, list, tuple, tensor, "
        "bytes, None, bool, int, float, str, and objects with state_dict() and "
        "load_state_dict())",
        path=path_str(path),
        type=type(value).__qualname__,
    )


def _bytes_node(
    value: bytes | bytearray | memoryview,
    path: tuple[str | int, ...],
    tensors: list[tuple[str, torch.Tensor]],
    where: dict[str, tuple[str | int, ...]],
) -> dict[str, Any]:
    """Raw bytes: an opaque blob, chunked, hashed and verified like a tensor's bytes
    (a 1-D uint8 entry), and never interpreted."""
    data = bytes(value)
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)
    return {"bytes": _add_tensor(blob, path, tensors, where)}


def _add_tensor(
    tensor: torch.Tensor,
    path: tuple[str | int, ...],
    tensors: list[tuple[str, torch.Tensor]],
    where: dict[str, tuple[str | int, ...]],
) -> str:
    name = _tensor_name(path)
    if not name or len(name) > MAX_NAME_LEN:
        raise UnsupportedValue(
            f"tensor at {path_str(path)} has the name {name[:80]!r}, which is empty or longer "
            f"than {MAX_NAME_LEN}",
            path=path_str(path),
        )
    if name in where:
        raise UnsupportedValue(
            f"tensors at {path_str(where[name])} and {path_str(path)} would both be named "
            f"{name!r}; rename one of the keys",
            name=name,
            paths=[path_str(where[name]), path_str(path)],
        )
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise UnsupportedValue(
            f"tensor at {path_str(path)} has layout {tensor.layout}; only dense tensors "
            "can be checkpointed",
            path=path_str(path),
        )
    if tensor.device.type == "meta":
        raise UnsupportedValue(f"tensor at {path_str(path)} is on the meta device (no data)")
    try:
        dtype_name(tensor.dtype)
    except UnsupportedValue:
        raise UnsupportedValue(
            f"tensor at {path_str(path)} has dtype {tensor.dtype}, which the format lacks",
            path=path_str(path),
        ) from None
    where[name] = path
    tensors.append((name, tensor))
    return name


# -- restore: the tree back into a target state dict ------------------------------------


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
            f"{len(bad)} tensors in the target differ from the checkpoint in dtype, shape or "
            "shard: "
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
        return body
    if kind == "float":
        return float(body)
    if kind == "bytes":
        return tensors[body].contiguous().numpy().tobytes()
    if kind == "tensor":
        restored = tensors[body]
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
