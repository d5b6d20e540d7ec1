"""dcp.save of a sharded tensor, a plain tensor, bytes and a value by every rank,
then ``Checkpointer.restore`` of that step by every rank: into ``{}`` and into a
template of every key. DCP saves the replicated items once, on one rank.

argv: out url job."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import finish, init
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptd.client import Checkpointer
from ckptd.client.dcp import Writer
from ckptd.errors import CkptdError


def described(state: dict[str, Any]) -> dict[str, Any]:
    """What a restored state holds, as JSON: tensors by shape and values."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = {"shape": list(value.shape), "values": value.reshape(-1).tolist()}
        elif isinstance(value, bytes):
            out[key] = {"bytes": value.hex()}
        else:
            out[key] = {"value": value}
    return out


def stages(rank: int, url: str, job: str) -> dict[str, Any]:
    """Two pipeline stages: each rank holds its own stage's weight and the items
    both hold (a shared tensor, a value), which DCP saves once. Each rank's restore
    of the step gets its stage's and the shared items, not the other stage's."""
    state = {f"stage{rank}.w": torch.full((4,), float(rank)), "shared": torch.arange(2.0),
             "epoch": 3}
    dcp.save(state, storage_writer=Writer(url, job, 200, chunk_size=4096, timeout=60))
    with Checkpointer(url, job, rank=rank, world_size=2, serve_peers=False,
                      timeout=60) as ckpt:
        empty: dict[str, Any] = {}
        ckpt.restore(empty, 200)
    return {"stages": described(empty)}


def main() -> None:
    rank, world, out = init()
    url, job = sys.argv[2], sys.argv[3]
    if len(sys.argv) > 4 and sys.argv[4] == "stages":
        finish(out, rank, stages(rank, url, job))
        return
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    state = {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": torch.arange(3.0),
             "epoch": 7, "blob": b"\x00\x01ckptd"}
    dcp.save(state, storage_writer=Writer(url, job, 100, chunk_size=4096, timeout=60))
    result: dict[str, Any] = {}
    with Checkpointer(url, job, rank=rank, world_size=world, serve_peers=False,
                      timeout=60) as ckpt:
        empty: dict[str, Any] = {}
        ckpt.restore(empty, 100)
        result["empty"] = described(empty)
        template: dict[str, Any] = {"w": torch.zeros(3, 4), "b": torch.zeros(3),
                                    "epoch": 0, "blob": b""}
        try:
            ckpt.restore(template, 100)
            result["template"] = described(template)
        except CkptdError as exc:
            result["template"] = {"error": str(exc)}
    finish(out, rank, result)


if __name__ == "__main__":
    main()
