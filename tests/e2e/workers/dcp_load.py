"""dcp.load of steps 1 and 2 (saved by another world size) through ckptd's Reader.

argv: out url job."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import finish, init, same_bits
from dcp_state import LOAD, build, full_tensors, values
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ckptd.client.dcp import Reader


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(state: dict[str, Any], step: int) -> dict[str, Any]:
    expected = full_tensors(step)
    got = {f"model.{k}": v for k, v in state["model"].items()}
    got["optim.exp_avg"] = state["optim"]["state"]["model.w"]["exp_avg"]
    v = values(step)
    groups = state["optim"]["param_groups"]
    return {
        "tensors": {name: same_bits(full(got[name]), t) for name, t in expected.items()},
        "dtensors_kept": all(isinstance(state["model"][k], DTensor)
                             for k in ("w", "big", "w2", "emb", "rep")),
        "optim_step": float(state["optim"]["state"]["model.w"]["step"]) == float(step),
        "epoch": state["epoch"] == step,
        "note": state["note"] == v["note"],
        "best": math.isinf(state["best"]),
        "param_groups": groups == v["param_groups"],
        "betas_tuple": isinstance(groups[0]["betas"], tuple),
    }


def main() -> None:
    rank, world, out = init()
    url, job = sys.argv[2], sys.argv[3]
    mesh = init_device_mesh("cpu", (world,))
    result: dict[str, Any] = {}
    for step, reader in ((1, Reader(url, job, 1, timeout=60)), (2, Reader(url, job, timeout=60))):
        state = build(mesh, LOAD, 0, zero=True)
        dcp.load(state, storage_reader=reader)
        result[str(step)] = {**compare(state, step), "loaded_step": reader.loaded_step,
                             "bytes_read": reader.bytes_read}
    finish(out, rank, result)


if __name__ == "__main__":
    main()
