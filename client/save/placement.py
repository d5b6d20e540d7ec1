"""Each saved tensor's placement: ``sharded`` (a ``Shard`` or a DTensor's layout),
``local`` (rank-private) or the checkpointer's default."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import InvalidRequest
from ckptd.format import Placement


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a rank's tensor sits in a global tensor: this rank holds
    ``global[offsets[0] : offsets[0] + t.shape[0], ...]``."""

    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        g = _dims(self.global_shape, "global_shape")
        o = _dims(self.offsets, "offsets")
        if len(g) != len(o):
            raise InvalidRequest(
                f"Shard: global_shape {list(g)} and offsets {list(o)} differ in rank"
            )
        if any(d < 0 for d in g + o):
            raise InvalidRequest("Shard: negative dimension or offset")
        object.__setattr__(self, "global_shape", g)
        object.__setattr__(self, "offsets", o)


def _dims(values: Any, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints; a typed error for anything else."""
    try:
        return tuple(operator.index(d) for d in values)
    except TypeError:
        raise InvalidRequest(
            f"Shard: {what} must be a list of ints, e.g. Shard([8, 4], [0, 0]), not "
            f"{values!r:.80}"
        ) from None


def placements(
    tensors: list[tuple[str, torch.Tensor]],
    shards: Mapping[str, Shard],
    local: Iterable[str],
    layouts: Mapping[str, tuple[Placement, list[int], list[int]]] | None,
    default_placement: Placement,
) -> dict[str, tuple[Placement, list[int], list[int]]]:
    """Each tensor's (placement, global shape, offsets): an explicit ``shards``
    or ``local`` entry wins, then the layout a DTensor's placements gave
    (``layouts``, from ``flatten``), then ``default_placement``."""
    layouts = layouts or {}
    by_name = dict(tensors)
    local_names = set(local)
    unknown = sorted((set(shards) | local_names) - by_name.keys())
    if unknown:
        raise InvalidRequest(
            f"shards or local name tensors the state does not hold: {unknown[:10]}",
            names=unknown[:50],
        )
    both = sorted(set(shards) & local_names)
    if both:
        raise InvalidRequest(f"tensors both sharded and local: {both[:10]}", names=both[:50])
    out: dict[str, tuple[Placement, list[int], list[int]]] = {}
    for name, tensor in tensors:
        shape = [int(d) for d in tensor.shape]
        shard = shards.get(name)
        if shard is not None:
            if not isinstance(shard, Shard):
                raise InvalidRequest(
                    f"shards[{name!r}] is a {type(shard).__name__}: pass "
                    f"Shard(global_shape, offsets)",
                    name=name,
                )
            g, o = list(shard.global_shape), list(shard.offsets)
            if len(g) != len(shape) or any(
                a + s > d for a, s, d in zip(o, shape, g, strict=True)
            ):
                raise InvalidRequest(
                    f"shard of {name!r} with shape {shape} at offsets {o} does not fit "
                    f"in global shape {g}",
                    name=name,
                )
            out[name] = ("sharded", g, o)
        elif name in local_names:
            out[name] = ("local", shape, [0] * len(shape))
        elif name in layouts:
            placement, g, o = layouts[name]
            g, o = [int(d) for d in g], [int(d) for d in o]
            if len(g) != len(shape) or len(o) != len(shape) or any(
                a < 0 or a + s > d for a, s, d in zip(o, shape, g, strict=True)
            ):
                raise InvalidRequest(
                    f"the layout of {name!r} (global shape {g}, offsets {o}) does not "
                    f"fit its local shape {shape}",
                    name=name,
                )
            out[name] = (placement, g, o)
        else:
            out[name] = (default_placement, shape, [0] * len(shape))
    return out

