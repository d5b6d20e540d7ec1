"""A non-tensor value handed to a DCP load planner. DCP's own planner takes a value
as bytes and ``torch.load``s them with ``weights_only=False``; ckptd gives that
planner the value itself (built from the store with ``weights_only=True``, or a
JSON value), as its ``load_bytes`` would place it, so no unpickling of any kind
happens on its side. A planner with a ``load_bytes`` of its own still gets bytes:
ckptd's own ``torch.save`` of the value, never the store's."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def deliver_value(planner: Any, read_item: Any, value: Any) -> None:
    """``value`` put where DCP's ``DefaultLoadPlanner.load_bytes`` puts what it
    unpickles (the flattened state's mapping, or the state dict by name)."""
    fqn = read_item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def give_value(planner: Any, read_item: Any, value: Any) -> None:
    """``value`` to ``planner``: placed directly for DCP's own ``load_bytes``, else
    as ckptd's ``torch.save`` of it for the planner's ``load_bytes``."""
    if isinstance(planner, DefaultLoadPlanner) and (
            type(planner).load_bytes is DefaultLoadPlanner.load_bytes):
        deliver_value(planner, read_item, value)
        return
    buf = io.BytesIO()
    torch.save(value, buf)  # our own bytes, for the planner's torch.load
    buf.seek(0)
    planner.load_bytes(read_item, buf)
