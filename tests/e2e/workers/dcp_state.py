"""The state the DCP workers save and load: DTensors sharded on several dims,
a replicated DTensor, a plain tensor, and plain values."""

from __future__ import annotations

from typing import Any

import torch
from common import global_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

# name -> (global shape, dtype)
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.w": ((10, 6), torch.float32),
    "model.big": ((64, 256), torch.float32),  # 64 KiB: several chunks per shard
    "model.w2": ((16, 4), torch.bfloat16),
    "model.emb": ((4, 10), torch.float32),
    "model.rep": ((3, 3), torch.float64),
    "model.bias": ((6,), torch.float32),
    "optim.exp_avg": ((10, 6), torch.float32),
}

# How each rank holds them when saving (4 ranks) and loading (2 ranks): the load
# reshards across dimensions too (w2 saved by rows, loaded by columns).
SAVE = {"model.w": [Shard(0)], "model.big": [Shard(0)], "model.w2": [Shard(0)],
        "model.emb": [Shard(1)], "model.rep": [Replicate()], "model.bias": None,
        "optim.exp_avg": [Shard(0)]}
LOAD = {"model.w": [Shard(0)], "model.big": [Shard(0)], "model.w2": [Shard(1)],
        "model.emb": [Shard(0)], "model.rep": [Shard(0)], "model.bias": None,
        "optim.exp_avg": [Replicate()]}


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    return {name: global_tensor(1000 * step + i, shape, dtype)
            for i, (name, (shape, dtype)) in enumerate(TENSORS.items())}


def values(step: int) -> dict[str, Any]:
    return {
        "epoch": step,
        "note": f"héllo {step}",
        "best": float("inf"),
        "param_groups": [{"lr": 0.1 * step, "betas": (0.9, 0.99), "params": ["model.w"],
                          "foreach": None}],
    }


def build(mesh: DeviceMesh, layout: dict[str, Any], step: int, zero: bool) -> dict[str, Any]:
    """A nested state dict; ``zero`` gives the same structure with zeros and other
    values (a load target)."""
    tensors = {}
    for name, g in full_tensors(step).items():
        g = torch.zeros_like(g) if zero else g
        placements = layout[name]
        tensors[name] = g if placements is None else distribute_tensor(g, mesh, placements)
    v = values(0 if zero else step)
    if zero:
        v["best"] = 0.0
    return {
        "model": {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith("model.")},
        "optim": {
            "state": {"model.w": {"step": torch.tensor(float(step) if not zero else 0.0),
                                  "exp_avg": tensors["optim.exp_avg"]}},
            "param_groups": v["param_groups"],
        },
        "epoch": v["epoch"],
        "note": v["note"],
        "best": v["best"],
    }
