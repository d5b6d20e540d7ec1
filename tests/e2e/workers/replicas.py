"""Data-parallel replicas: every rank holds the same state and saves one step.

argv: out url job step chunk_size. Reports what its snapshot sent and whether a
restore into zeroed tensors gave the saved bytes back."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import finish, global_tensor, init, same_bits

from ckptd.client import Checkpointer
from ckptd.client.dtypes import byte_view
from ckptd.client.save.flatten import flatten
from ckptd.hashing import chunk_id, chunk_spans


def replica_state() -> dict[str, Any]:
    """The state every replica holds: a little model, its optimizer state, scalars."""
    return {
        "model": {
            "embed": global_tensor(1, (96, 256)),  # 96 KiB: several chunks
            "proj": global_tensor(2, (256, 64), torch.bfloat16),
            "bias": global_tensor(3, (64,)),
        },
        "optim": {"state": {0: {"step": torch.tensor(7.0), "m": global_tensor(4, (96, 256))}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0]}]},
        "step": 7,
    }


def distinct_chunks(state: dict[str, Any], chunk_size: int) -> dict[str, int]:
    """Chunk id -> size over the state's tensors: what one replica must send."""
    out: dict[str, int] = {}
    for _, t in flatten(state).tensors:
        view = byte_view(t.contiguous())
        for a, b in chunk_spans(len(view), chunk_size):
            out[chunk_id(view[a:b])] = b - a
    return out


def main() -> None:
    rank, world, out = init()
    url, job, step, chunk_size = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    state = replica_state()
    with Checkpointer(url, job, rank=rank, world_size=world, chunk_size=chunk_size,
                      timeout=60) as ckpt:
        dist.barrier()  # start together: the replicas race for the same chunk ids
        result = ckpt.save(step, state).wait(timeout=60)
        dist.barrier()  # every manifest is in: the last rank's commit went through
        latest = ckpt.latest()
        target = {
            "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"state": {}, "param_groups": [{}]},
            "step": 0,
        }
        restored = ckpt.restore(target)
    expected = flatten(state).tensors
    got = dict(flatten(target).tensors)
    chunks = distinct_chunks(state, chunk_size)
    finish(out, rank, {
        "bytes_sent": result.bytes_sent,
        "chunks_sent": result.chunks_sent,
        "bytes_staged": result.bytes_staged,
        "state": result.state,
        "latest": latest,
        "restored_step": restored.step,
        "restored_bitwise": all(same_bits(t, got[n]) for n, t in expected),
        "restored_values": target["step"] == 7 and target["optim"]["param_groups"][0]["lr"] == 0.01,
        "distinct_chunks": chunks,
    })


if __name__ == "__main__":
    main()
