"""State dicts as the manifest's tree skeleton plus named tensors.

``flatten`` turns what ``model.state_dict()``, ``optimizer.state_dict()``, LR
schedulers and plain Python produce into the format's tree (see
``ckptd.format.check_tree``) and a list of tensors named by their keys joined with
".". Nothing is pickled: a leaf the tree cannot hold is refused with its path.

A ``DTensor`` leaf is stored as its local shard: ``flatten`` puts ``to_local()`` in
``FlatState.tensors`` and the shard's placement, global shape and offsets (from
the DTensor's placements, see ``ckptd.client.sharding``) in ``FlatState.layouts``.
The way back into a target is ``ckptd.client.restore.fill``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import UnsupportedValue
from ckptd.format import MAX_NAME_LEN, MAX_TREE_DEPTH, Placement

from ..dtypes import dtype_name, path_str
from ..sharding import dtensor_layout, is_dtensor, local_tensor


def _tensor_name(path: Sequence[str | int]) -> str:
    return ".".join(map(str, path))


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
    # What a state is mostly made of first, by exact type (a save walks every node of
    # the state each step: its time is the training loop's stall).
    cls = type(value)
    if cls is torch.Tensor:
        return {"tensor": _add_tensor(value, path, tensors, where)}
    if cls is dict:
        return _mapping_node(value, path, tensors, where, layouts, local)
    if cls is str and value.isascii() or cls is int:
        return {"value": value}
    if cls is float and math.isfinite(value):
        return {"value": value}
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
        return _mapping_node(value, path, tensors, where, layouts, local)
    if type(value) is list or type(value) is tuple or type(value) is torch.Size:
        kind = "list" if type(value) is list else "tuple"
        return {
            kind: [
                _flatten_node(c, (*path, i), tensors, where, layouts, local)
                for i, c in enumerate(value)
            ]
        }
    named = f"{type(value).__module__}.{type(value).__qualname__}"
    raise UnsupportedValue(
        f"{path_str(path)} holds {'an' if named[0].lower() in 'aeiou' else 'a'} {named}, "
        "which ckptd cannot store without pickling (supported: dict, list, tuple, tensor, "
        "bytes, None, bool, int, float, str, and objects with state_dict() and "
        "load_state_dict())",
        path=path_str(path),
        type=type(value).__qualname__,
    )


def _mapping_node(
    value: Mapping[Any, Any],
    path: tuple[str | int, ...],
    tensors: list[tuple[str, torch.Tensor]],
    where: dict[str, tuple[str | int, ...]],
    layouts: dict[str, tuple[Placement, list[int], list[int]]],
    local: set[str] | None,
) -> dict[str, Any]:
    items: list[list[Any]] = []
    for key, child in value.items():
        if type(key) is not str:
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise UnsupportedValue(
                    f"{path_str(path)} has a key {key!r} of type {type(key).__name__}; "
                    "only str and int keys can be checkpointed",
                    path=path_str(path),
                )
            key = str.__str__(key) if isinstance(key, str) else int(key)
        items.append([key, _flatten_node(child, (*path, key), tensors, where, layouts, local)])
    return {"dict": items}


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


def not_storable(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s bytes cannot be stored as they are, and what to do (the
    end of a sentence that names it); None for a dense tensor with data."""
    if tensor.is_quantized:
        return ("is quantized; only dense tensors can be checkpointed (dequantize it, or "
                "save its parts)")
    if tensor.is_nested:
        return ("is nested; only dense tensors can be checkpointed (.unbind() it into "
                "its tensors, and save those)")
    if tensor.layout != torch.strided:
        return (f"has layout {tensor.layout}; only dense tensors can be checkpointed "
                "(save .to_dense(), or its indices and values)")
    if tensor.device.type == "meta":
        return ("is on the meta device (no data): materialize it first, e.g. "
                "model.to_empty(device=...), then load or initialize its weights")
    return None


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
            f"than {MAX_NAME_LEN}; rename it (its key, or the keys that lead to it)",
            path=path_str(path),
        )
    if name in where:
        raise UnsupportedValue(
            f"tensors at {path_str(where[name])} and {path_str(path)} would both be named "
            f"{name!r}; rename one of the keys",
            name=name,
            paths=[path_str(where[name]), path_str(path)],
        )
    refusal = not_storable(tensor)
    if refusal is not None:
        raise UnsupportedValue(f"tensor at {path_str(path)} {refusal}", path=path_str(path))
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
