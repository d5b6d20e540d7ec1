"""Steps for the safetensors export, saved by several ranks: DTensors through a
Checkpointer (Shard(0) even, uneven and with empty shards, Shard(1), bf16,
Replicate, HSDP on 4 ranks; the dtensor worker's layouts), and through DCP a
ShardedTensor placing two shards on each rank beside a DTensor Shard(1).
Rank 0 writes every global tensor, as the export should name it, with torch.save.

argv: out url job. Step 1: the Checkpointer's; step 2: DCP's."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import finish, global_tensor, init
from dtensor import build
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptd.client import Checkpointer
from ckptd.client.dcp import Writer


def main() -> None:
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
    rank, world, out = init()
    url, job = sys.argv[2], sys.argv[3]
    state, full = build(world, zero=False)
    with Checkpointer(url, job, rank=rank, world_size=world, timeout=60,
                      chunk_size=4096) as ckpt:
        saved = ckpt.save(1, state).wait(timeout=60).state
    expected = {f"model.{k}": v for k, v in full.items()}
    expected["plain"] = state["plain"]

    torch.manual_seed(rank)
    places = [f"rank:{r}" for r in range(world)]
    spec = ChunkShardingSpec(dim=0, placements=places + places[::-1])  # 2 shards a rank
    st = sharded_tensor.rand(spec, 6 * world, 6, init_rrefs=False)  # 3 rows a shard
    whole = torch.zeros(st.shape) if rank == 0 else None
    st.gather(dst=0, out=whole)
    cols = global_tensor(7, (5, 2 * world + 1))
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"st": st, "cols": distribute_tensor(cols, mesh, [Shard(1)])},
             storage_writer=Writer(url, job, 2, chunk_size=4096))
    if rank == 0:
        torch.save(expected, out / "step1.pt")
        torch.save({"st": whole, "cols": cols}, out / "step2.pt")
    dist.barrier()
    finish(out, rank, {"saved": saved})


if __name__ == "__main__":
    main()
