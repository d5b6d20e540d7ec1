"""The target's keys against the checkpoint's tree, before a restore writes anything.

``strict`` (the default, like torch's ``load_state_dict``): an entry the target
holds that the checkpoint lacks, or an entry of the checkpoint that a module's
``state_dict()`` has no place for, is refused with ``RestoreError`` while the
target is still as it was. A module's ``load_state_dict()`` would raise the same
only after its other tensors were overwritten. Optimizers, schedulers and
``RNGState`` are left to their own ``load_state_dict()``: a fresh optimizer has
no state yet, and the generators a machine has (CUDA, NumPy) vary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from ckptd.errors import InvalidRequest, RestoreError

from ..dtypes import path_str
from ..stateful import ModelState, has_stateful, is_stateful

Path = tuple[str | int, ...]
Kind = Literal["module", "own"]  # checked key by key / checked by its own load_state_dict

_SHOWN = 5


def stateful_kinds(state: Any) -> dict[Path, Kind]:
    """Where ``restore_view`` puts each Stateful object's ``state_dict()``, and how
    its keys are checked: a module's (or ``ModelState``'s model) key by key, the
    others by their own ``load_state_dict()``."""
    kinds: dict[Path, Kind] = {}

    def walk(mapping: Mapping[Any, Any], path: Path) -> None:
        for key, value in mapping.items():
            here = (*path, key)
            if isinstance(value, torch.nn.Module):
                kinds[here] = "module"
            elif isinstance(value, ModelState):
                kinds[(*here, "model")] = "module"
                kinds[(*here, "optim")] = "own"
            elif is_stateful(value):
                kinds[here] = "own"
            elif isinstance(value, Mapping) and has_stateful(value):
                walk(value, here)

    if isinstance(state, Mapping):
        walk(state, ())
    return kinds


def stateful_places(state: Any) -> dict[Path, str]:
    """Where each Stateful object of the target sits, with its type's name;
    ``InvalidRequest`` for one inside a list or tuple, which ``restore_view`` does not
    reach (it was left as it was and its place in the list given a dict)."""
    places: dict[Path, str] = {}

    def walk(value: Any, path: Path, sequence: str | None) -> None:
        if is_stateful(value):
            if sequence is not None:
                raise InvalidRequest(
                    f"restore: {path_str(path)} is a {type(value).__name__} inside a "
                    f"{sequence}; restore loads such objects only as a mapping's values: "
                    "pass model.state_dict() in its place, or put it in a dict")
            places[path] = type(value).__name__
        elif isinstance(value, Mapping):
            for key, child in value.items():
                walk(child, (*path, key), sequence)
        elif isinstance(value, list | tuple):
            for i, child in enumerate(value):
                walk(child, (*path, i), sequence or type(value).__name__)

    walk(state, (), None)
    return places


def check_places(tree: Mapping[str, Any], places: Mapping[Path, str], step: int) -> None:
    """``InvalidRequest`` for a Stateful object where the checkpoint holds no state
    dict (a tensor, a value, a list): its ``load_state_dict()`` would refuse that with
    torch's TypeError once the rest was written. (One the checkpoint lacks is
    ``check_keys``'s.)"""
    for path, name in places.items():
        node = _node(tree, path)
        if node is None:
            continue
        ((what, _),) = node.items()
        if what != "dict":
            held = {"tensor": "a tensor", "value": "a plain value"}.get(what, f"a {what}")
            raise InvalidRequest(
                f"restore: {path_str(path)} is a {name}, but step {step} holds {held} "
                "there, not a state dict (a module restores where its model.state_dict() "
                f"was saved): pass {held} there")


def _node(tree: Mapping[str, Any], path: Path) -> Mapping[str, Any] | None:
    """The checkpoint tree's node at ``path`` through its mappings, or None."""
    node = tree
    for key in path:
        ((what, body),) = node.items()
        found = dict((k, child) for k, child in body).get(key) if what == "dict" else None
        if found is None:
            return None
        node = found
    return node


def check_keys(
    tree: Mapping[str, Any], target: Any, kinds: Mapping[Path, Kind], step: int
) -> None:
    """Raises ``RestoreError`` naming the first entries the target holds that the
    checkpoint's ``tree`` lacks, or that a module has no place for."""
    missing: list[Path] = []
    unexpected: list[Path] = []

    def walk(node: Mapping[str, Any], existing: Any, path: Path, in_module: bool) -> None:
        kind = kinds.get(path)
        if kind == "module":
            in_module = True
        elif kind == "own":
            return
        ((what, body),) = node.items()
        if what == "dict" and isinstance(existing, Mapping):
            stored = {key for key, _ in body}
            missing.extend((*path, key) for key, value in existing.items()
                           if key not in stored and _holds(value))
            for key, child in body:
                if key in existing:
                    walk(child, existing[key], (*path, key), in_module)
                elif in_module:
                    unexpected.append((*path, key))
        elif what in ("list", "tuple") and isinstance(existing, Sequence) and not isinstance(
            existing, str | bytes
        ):
            for i, child in enumerate(body[: len(existing)]):
                walk(child, existing[i], (*path, i), in_module)
            missing.extend((*path, i) for i in range(len(body), len(existing))
                           if _holds(existing[i]))

    walk(tree, target, (), False)
    if missing:
        raise RestoreError(
            f"the checkpoint of step {step} lacks {_entries(missing)} the target holds: "
            f"{_names(missing)}; restore(..., strict=False) leaves them as they are"
            + _nesting_hint(tree, target, kinds, missing),
            entries=[path_str(p) for p in missing[:50]], step=step,
        )
    if unexpected:
        raise RestoreError(
            f"the checkpoint of step {step} holds {_entries(unexpected)} the target's "
            f"modules have no place for: {_names(unexpected)}; restore(..., strict=False) "
            "skips them",
            entries=[path_str(p) for p in unexpected[:50]], step=step,
        )


def _entries(paths: list[tuple[Any, ...]]) -> str:
    return f"{len(paths)} entr{'y' if len(paths) == 1 else 'ies'}"


def _nesting_hint(tree: Any, target: Any, kinds: Mapping[Path, Kind],
                  missing: list[Path]) -> str:
    """A step nested otherwise than the target, said with the way to restore it: its
    top holds the names of one entry of the target (a flat import of a module's
    ``state_dict()``, restored as ``{"model": model}``), or the target's names sit
    one level down in it (``{"model": ...}`` saved, ``model.state_dict()`` given),
    or it holds flat names (``model.0.weight``: safetensors from elsewhere) where
    the target has a tree."""
    if not (isinstance(tree, Mapping) and isinstance(tree.get("dict"), list)):
        return ""
    stored = [key for key, _ in tree["dict"] if isinstance(key, str)]
    top = [p[0] for p in missing if len(p) == 1]
    for key in top:
        sub = target.get(key) if isinstance(target, Mapping) else None
        names = [k for k, v in sub.items() if _holds(v)] if isinstance(sub, Mapping) else []
        shared = [k for k in names if k in stored]
        if shared and 2 * len(shared) >= len(names):
            where = path_str((key,))
            how = (f"restore(model.state_dict()) of the module at {where}"
                   if kinds.get((key,)) == "module" else f"restore({where})")
            return (f". The step holds the names of {where} at its top (such as "
                    f"{shared[0]!r}: a flat import): {how} restores them")
    for key, child in tree["dict"]:
        ((what, body),) = child.items()
        inner = {k for k, _ in body} if what == "dict" else set()
        shared = [k for k in top if k in inner]
        if shared and 2 * len(shared) >= len(top):
            return (f". The step holds them one level down, under {key!r} (such as "
                    f"{path_str((key, shared[0]))}): restore({{{key!r}: model}}) (or a dict "
                    "nested so) restores them")
    for path in missing:
        if len(path) == 1 and isinstance(path[0], str):
            flat = [key for key in stored if key.startswith(f"{path[0]}.")]
            if flat:
                return (f". The step holds flat names such as {flat[0]!r} (safetensors "
                        "files imported from elsewhere): restore into a dict named as the "
                        "files name the tensors, a model's state_dict() where its names are "
                        "those (docs/integrations/safetensors.md)")
    return ""


def _holds(value: Any) -> bool:
    """Whether a value of the target would be restored (an empty container is not)."""
    if isinstance(value, Mapping):
        return bool(value)
    if isinstance(value, list | tuple):
        return len(value) > 0
    return True


def _names(paths: Sequence[Path]) -> str:
    shown = ", ".join(path_str(p) for p in paths[:_SHOWN])
    return shown + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")
