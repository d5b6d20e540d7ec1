"""Stateful objects in a checkpointed state: DCP's protocol (``state_dict()`` and
``load_state_dict()``), so a module, an optimizer, an LR scheduler or ``RNGState``
goes into ``save`` and ``restore`` as itself.

``save`` stores what ``state_dict()`` returns. ``restore`` fills a template (each
object's current ``state_dict()``: tensors filled in place, missing ones such as a
fresh optimizer's state created) and hands it to ``load_state_dict()``.
``RNGState`` covers Python's, NumPy's, torch's and CUDA's generators, rank-local
by default; ``ModelState`` goes through ``torch.distributed.checkpoint.state_dict``
(FSDP2, tensor parallel, DDP: fully qualified names, DTensor shards)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from .save.flatten import is_stateful


class RNGState:
    """The random generators of this process: Python's ``random``, NumPy's global
    generator (when NumPy is installed), torch's CPU generator and, where CUDA is
    available, every device's. Rank-local (``rank_local``): each rank saves and
    restores its own, so ranks that draw different numbers do not disagree as
    replicas."""

    rank_local = True

    def __init__(self, *, cuda: bool = True, numpy: bool = True) -> None:
        self.cuda = cuda
        self.numpy = numpy

    def __repr__(self) -> str:
        return f"RNGState(cuda={self.cuda}, numpy={self.numpy})"

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        out: dict[str, Any] = {
            "python": {"version": version,
                       "state": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss},
            "torch": torch.get_rng_state(),
        }
        np = _numpy() if self.numpy else None
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            out["numpy"] = {"kind": str(kind),
                            "keys": torch.from_numpy(keys.astype("int64")),
                            "pos": int(pos), "has_gauss": int(has_gauss),
                            "cached_gaussian": float(cached)}
        if self.cuda and torch.cuda.is_available():
            out["cuda"] = list(torch.cuda.get_rng_state_all())
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()),
                         py["gauss_next"]))
        torch.set_rng_state(state["torch"].to(torch.uint8))
        np = _numpy() if self.numpy else None
        if np is not None and "numpy" in state:
            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), int(n["pos"]),
                                 int(n["has_gauss"]), float(n["cached_gaussian"])))
        cuda = state.get("cuda")
        if self.cuda and cuda and torch.cuda.is_available():
            if len(cuda) != torch.cuda.device_count():  # another machine: best effort
                cuda = list(cuda)[: torch.cuda.device_count()]
            for device, s in enumerate(cuda):
                torch.cuda.set_rng_state(s.to(torch.uint8), device)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class ModelState:
    """A model and its optimizers, through
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
    ``set_state_dict``: fully qualified names for the optimizer state too, and
    DTensor shards for FSDP2 or tensor-parallel models (what DCP's own docs use as
    ``AppState``). ``options`` is a ``StateDictOptions``."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, *,
                 options: Any = None) -> None:
        self.model = model
        self.optimizers = () if optimizer is None else (
            tuple(optimizer) if isinstance(optimizer, list | tuple) else (optimizer,))
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model, "optim": optim} if self.optimizers else {"model": model}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=self.options)


def has_stateful(state: Any) -> bool:
    """True when a Stateful object sits in ``state`` (in its nested mappings)."""
    if is_stateful(state):
        return True
    return isinstance(state, Mapping) and any(has_stateful(v) for v in state.values())


def restore_view(
    state: MutableMapping[Any, Any], *, strict: bool = True,
) -> tuple[MutableMapping[Any, Any], Callable[[], None]]:
    """A target for ``restore`` that holds each Stateful object's ``state_dict()``
    in its place, and the function that, once the view is filled, loads each
    object's part and puts the other restored values back into ``state``
    (a module's with ``strict``, as torch's ``load_state_dict`` takes it)."""
    if not has_stateful(state):
        return state, lambda: None
    loads: list[tuple[Any, MutableMapping[Any, Any], Any]] = []
    copies: list[tuple[MutableMapping[Any, Any], MutableMapping[Any, Any]]] = []

    def view_of(mapping: MutableMapping[Any, Any]) -> dict[Any, Any]:
        view: dict[Any, Any] = {}
        for key, value in mapping.items():
            if is_stateful(value):
                view[key] = value.state_dict()
                loads.append((value, view, key))
            elif isinstance(value, MutableMapping) and has_stateful(value):
                view[key] = view_of(value)
            else:
                view[key] = value
        copies.append((mapping, view))
        return view

    top = view_of(state)

    def apply() -> None:
        for obj, view, key in loads:
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(view[key], strict=strict)
            else:
                obj.load_state_dict(view[key])
        for original, view in copies:
            for key, value in view.items():
                if key in original and (is_stateful(original[key]) or (
                        isinstance(original[key], MutableMapping)
                        and has_stateful(original[key]))):
                    continue
                original[key] = value

    return top, apply


__all__ = ["ModelState", "RNGState", "has_stateful", "is_stateful", "restore_view"]
