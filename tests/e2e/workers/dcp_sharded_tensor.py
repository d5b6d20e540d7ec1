"""ShardedTensors with several local shards per rank through ckptd's DCP Writer and
Reader, 2 gloo ranks (written for ckptd after the scenarios of PyTorch's
TestDistributedReshardOnLoad): every sharding plan saved, then loaded into every
other plan; a sharded tensor loaded into a plain one and a plain tensor into a
sharded one. ``threads`` sets the Writer's upload concurrency and the Reader's
fetch concurrency (FileSystemWriter's thread_count). Then a Checkpointer restore
of a step whose ranks hold several shards of one tensor.

argv: out url job threads. Each rank writes ``{scenario: ok}``."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import finish, init, same_bits
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)

from ckptd.client import Checkpointer
from ckptd.client.dcp import Reader, Writer


def enumerable(rows: list[tuple[int, int, int]], cols: int | None) -> EnumerableShardingSpec:
    """Shards of (offset, length, rank) along dim 0 (of [.., cols] when cols)."""
    return EnumerableShardingSpec(shards=[
        ShardMetadata(shard_offsets=[o, 0] if cols else [o],
                      shard_sizes=[n, cols] if cols else [n], placement=f"rank:{r}")
        for o, n, r in rows
    ])


def plans(cols: int | None, size: int) -> dict[str, Any]:
    """Sharding plans of a [size(, cols)] tensor: even halves, four chunks placed
    0,1,1,0 (two shards on each rank), and uneven enumerable ones."""
    if cols:
        uneven = [(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)]  # 3 shards on rank 0
        other = [(0, 8, 1), (8, 2, 0)]
    else:
        uneven = [(0, 8, 1), (8, size - 8, 0)]
        other = [(0, 10, 0), (10, size - 10, 1)]
    return {
        "halves": ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        "0110": ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        "uneven": enumerable(uneven, cols),
        "other": enumerable(other, cols),
    }


def gathered(st: Any) -> torch.Tensor:
    """The whole tensor of a ShardedTensor, on every rank."""
    full = torch.zeros(st.shape) if dist.get_rank() == 0 else None
    st.gather(dst=0, out=full)
    out = full if full is not None else torch.empty(st.shape)
    dist.broadcast(out, src=0)
    return out


def main() -> None:
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
    rank, world, out = init()
    url, job, threads = sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.environ["CKPTD_UPLOAD_CONCURRENCY"] = str(threads)
    results: dict[str, bool] = {}
    step = iter(range(1, 10_000))
    torch.manual_seed(rank)

    def save(state: dict[str, Any]) -> int:
        s = next(step)
        dcp.save(state, storage_writer=Writer(url, job, s))
        return s

    def load(state: dict[str, Any], s: int) -> None:
        dcp.load(state, storage_reader=Reader(url, job, s, concurrency=threads))

    # Load with a different shard plan: [10, 20], every plan into every other one.
    specs = plans(20, 10)
    saved: dict[str, tuple[int, torch.Tensor]] = {}
    for name, spec in specs.items():
        st = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
        saved[name] = (save({"sharded_tensor": st}), gathered(st))
    for a, (s, truth) in saved.items():
        for b, spec in specs.items():
            if a == b:
                continue
            target = {"sharded_tensor": sharded_tensor.zeros(spec, 10, 20, init_rrefs=False)}
            load(target, s)
            results[f"plan {a}->{b}"] = same_bits(gathered(target["sharded_tensor"]), truth)

    # Sharded <-> plain tensor: a ShardedTensor loaded into a plain tensor, a plain
    # (replicated) tensor into a ShardedTensor, every plan to every plan.
    size = 32
    specs = plans(None, size)
    for a, save_spec in specs.items():
        plain = torch.rand(size)
        dist.broadcast(plain, src=0)
        st = sharded_tensor.rand(save_spec, size, init_rrefs=False)
        s = save({"sharded": st, "replicated": plain})
        truth = gathered(st)
        for b, load_spec in specs.items():
            target = {"sharded": torch.zeros(size),
                      "replicated": sharded_tensor.zeros(load_spec, size, init_rrefs=False)}
            load(target, s)
            results[f"switch {a}->{b}"] = (same_bits(target["sharded"], truth)
                                          and same_bits(gathered(target["replicated"]), plain))

    # A Checkpointer restores the step too: a tensor this rank holds several shards
    # of comes back whole.
    st = sharded_tensor.rand(plans(20, 10)["0110"], 10, 20, init_rrefs=False)
    s = save({"w": st})
    truth = gathered(st)
    with Checkpointer(url, job, rank=rank, world_size=world, serve_peers=False) as ckpt:
        restored: dict[str, Any] = {}
        ckpt.restore(restored, step=s)
    results["checkpointer restore"] = same_bits(restored["w"], truth)
    finish(out, rank, results)


if __name__ == "__main__":
    main()
