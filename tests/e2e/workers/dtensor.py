"""DTensor state through Checkpointer: Shard(0) even and uneven (empty shards
too), Shard(1), Replicate(), and HSDP (Replicate x Shard(0) on a 2-D mesh).

argv: out url job. Saves step 1, restores into fresh zeroed DTensors of the same
layout, and reports per tensor whether the local shard and the full tensor came
back bitwise."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import finish, global_tensor, init, same_bits
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptd.client import Checkpointer


def layouts(world: int) -> dict[str, tuple[tuple[int, ...], torch.dtype, str, list[Any]]]:
    """name -> (global shape, dtype, mesh, placements)."""
    out = {
        "even": ((8, 6), torch.float32, "1d", [Shard(0)]),
        "uneven": ((10, 3), torch.float32, "1d", [Shard(0)]),  # 3, 3, 3, 1 rows
        "tiny": ((2, 5), torch.float32, "1d", [Shard(0)]),  # 1, 1, 0, 0: empty shards
        "cols": ((4, 9), torch.float32, "1d", [Shard(1)]),  # 3, 3, 3, 0 columns
        "half": ((6, 4), torch.bfloat16, "1d", [Shard(0)]),
        "rep": ((5,), torch.float64, "1d", [Replicate()]),
    }
    if world == 4:
        out["hsdp"] = ((7, 4), torch.float32, "2d", [Replicate(), Shard(0)])
    return out


def build(world: int, zero: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
    model: dict[str, Any] = {}
    full: dict[str, torch.Tensor] = {}
    for i, (name, (shape, dtype, mesh, placements)) in enumerate(layouts(world).items()):
        g = global_tensor(100 + i, shape, dtype)
        full[name] = g
        model[name] = distribute_tensor(torch.zeros_like(g) if zero else g, meshes[mesh],
                                        placements)
    state = {"model": model, "plain": global_tensor(9, (3,)), "step": 0 if zero else 5}
    return state, full


def main() -> None:
    rank, world, out = init()
    url, job = sys.argv[2], sys.argv[3]
    state, full = build(world, zero=False)
    with Checkpointer(url, job, rank=rank, world_size=world, timeout=60,
                      chunk_size=4096) as ckpt:
        result = ckpt.save(1, state).wait(timeout=60)
        dist.barrier()
        latest = ckpt.latest()
        target, _ = build(world, zero=True)
        target_ids = {k: id(v) for k, v in target["model"].items()}
        ckpt.restore(target)
    checks: dict[str, Any] = {}
    for name, dt in target["model"].items():
        assert isinstance(dt, DTensor)
        checks[name] = {
            "same_object": id(dt) == target_ids[name],
            "local": same_bits(dt.to_local(), state["model"][name].to_local()),
            "full": same_bits(dt.full_tensor(), full[name]),  # a collective: every rank
        }
    finish(out, rank, {
        "state": result.state,
        "latest": latest,
        "checks": checks,
        "step": target["step"],
        "plain": same_bits(target["plain"], state["plain"]),
    })


if __name__ == "__main__":
    main()
