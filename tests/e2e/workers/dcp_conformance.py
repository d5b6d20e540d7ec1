"""DCP's own scenarios on ckptd's Writer and Reader, 4 gloo ranks: DTensor
resharding (placement changes on a 1-D and a 2-D mesh, 1-D <-> 2-D mesh changes,
as in PyTorch's test_dtensor_resharding), FSDP2 and HSDP (a 2-D mesh) models and optimizers through
``get_state_dict`` / ``set_state_dict`` (``ModelState``) with ``dcp.save`` and
with ``Checkpointer``, and a DDP train state with a ``BytesIO`` item (as in
PyTorch's end-to-end save/load test). One job, one step per scenario.

argv: out url. Each rank writes ``{scenario: ok}``."""

from __future__ import annotations

import io
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import finish, init, same_bits
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

from ckptd.client import Checkpointer, ModelState
from ckptd.client.dcp import Reader, Writer

ONE_D = [[Shard(0)], [Replicate()]]
TWO_D = [[Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()],
         [Shard(0), Shard(0)]]


def main() -> None:
    rank, world, out = init()
    url = sys.argv[2]
    results: dict[str, bool] = {}
    step = iter(range(1, 10_000))
    full = torch.arange(16, dtype=torch.float32).view(4, 4)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))

    # Every scenario is one entry of one state: one save, one load (fast on 2 cores).
    saved: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    meshes: dict[str, tuple[Any, list[Any], Any, list[Any]]] = {}

    def reshard(name: str, mesh_a: Any, pa: list[Any], mesh_b: Any, pb: list[Any]) -> None:
        saved[name] = distribute_tensor(full, mesh_a, pa)
        targets[name] = zeros([4, 4], device_mesh=mesh_b, placements=pb)
        meshes[name] = (mesh_a, pa, mesh_b, pb)

    for pa in ONE_D:
        for pb in ONE_D:
            if pa != pb:
                reshard(f"1d {pa}->{pb}", mesh1, pa, mesh1, pb)
    for pa in TWO_D:
        for pb in TWO_D:
            if pa != pb:
                reshard(f"2d {pa}->{pb}", mesh2, pa, mesh2, pb)
    for pa in ONE_D:
        for pb in TWO_D:
            reshard(f"mesh 1d {pa}->2d {pb}", mesh1, pa, mesh2, pb)
    for pa in TWO_D:
        for pb in ONE_D:
            reshard(f"mesh 2d {pa}->1d {pb}", mesh2, pa, mesh1, pb)
    s = next(step)
    dcp.save(saved, storage_writer=Writer(url, "conf", s))
    dcp.load(targets, storage_reader=Reader(url, "conf", s))
    for name, (mesh_a, pa, mesh_b, _pb) in meshes.items():
        got = targets[name]
        ok = same_bits(got.redistribute(mesh_b, [Replicate()] * mesh_b.ndim).to_local(), full)
        if mesh_a is mesh_b:
            ok = ok and same_bits(got.redistribute(mesh_a, pa).to_local(),
                                  saved[name].to_local())
        results[name] = ok

    results.update(fsdp2(url, mesh1, next(step), next(step), "fsdp2"))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    results.update(fsdp2(url, hsdp, next(step), next(step), "hsdp"))
    results["ddp train_state BytesIO"] = ddp_train_state(url, next(step))
    finish(out, rank, results)


def _fsdp_model(seed: int, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optim


def _train(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(4, 8, generator=g)).sum().backward()
        optim.step()


def _same(a: ModelState, b: ModelState) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    ta = {k: v.full_tensor() for k, v in sa["model"].items()}
    tb = {k: v.full_tensor() for k, v in sb["model"].items()}
    oa, ob = sa["optim"]["state"], sb["optim"]["state"]
    same = all(same_bits(ta[k], tb[k]) for k in ta)
    for fqn in oa:
        for key in ("exp_avg", "exp_avg_sq"):
            same = same and same_bits(oa[fqn][key].full_tensor(), ob[fqn][key].full_tensor())
    return same and set(oa) == set(ob) and len(oa) > 0


def fsdp2(url: str, mesh: Any, s_dcp: int, s_ckpt: int, label: str) -> dict[str, bool]:
    model, optim = _fsdp_model(0, mesh)
    _train(model, optim, 0)
    saved = ModelState(model, optim)
    dcp.save({"app": saved}, storage_writer=Writer(url, "conf", s_dcp))
    fresh = ModelState(*_fsdp_model(1, mesh))
    dcp.load({"app": fresh}, storage_reader=Reader(url, "conf", s_dcp))
    via_dcp = _same(saved, fresh)

    rank, world = dist.get_rank(), dist.get_world_size()
    with Checkpointer(url, job=f"conf-{label}", rank=rank, world_size=world) as ckpt:
        ckpt.save(s_ckpt, {"app": saved}).wait(120)
        dist.barrier()
        again = ModelState(*_fsdp_model(2, mesh))
        step = ckpt.restore({"app": again}).step
    return {f"{label} ModelState dcp.save/load": via_dcp,
            f"{label} ModelState Checkpointer": step == s_ckpt and _same(saved, again)}


def ddp_train_state(url: str, s: int) -> bool:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    losses = io.BytesIO()
    torch.save([0.5, 0.25, 0.125], losses)  # replicas hold the same train state
    state = {"model": model.state_dict(), "train_state": {"step": 3, "losses": losses}}
    dcp.save(state, storage_writer=Writer(url, "conf", s))
    torch.manual_seed(1)
    other = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    target: dict[str, Any] = {"model": other.state_dict(),
                              "train_state": {"step": 0, "losses": io.BytesIO()}}
    dcp.load(target, storage_reader=Reader(url, "conf", s))
    got = target["train_state"]["losses"]
    return (target["train_state"]["step"] == 3 and isinstance(got, io.BytesIO)
            and torch.load(io.BytesIO(got.getvalue()), weights_only=True) == [0.5, 0.25, 0.125]
            and all(same_bits(target["model"][k], state["model"][k]) for k in state["model"]))


if __name__ == "__main__":
    main()
