"""A committed two-rank step with every kind of entry the zarr view must show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.client import Checkpointer, Shard

CHUNK = 4096
JOB = "zv"


def rank_state(r: int) -> dict[str, Any]:
    """Rank ``r``'s state: a bf16 weight sharded by rows (2 ranks), replicated fp32,
    int64 and bool tensors, 0-dim tensors, nested dicts and plain leaves."""
    g = torch.Generator().manual_seed(7)
    bf = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    return {
        "model": {
            "layers.0.attn.w": bf[32 * r : 32 * r + 32].clone(),
            "embed": torch.randn(300, 256, generator=g),  # 300 KiB, 4 rows per chunk
            "ids": torch.arange(3000, dtype=torch.int64),
            "mask": torch.arange(50) % 3 == 0,
        },
        "optim": {
            "state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(40, generator=g)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": float("inf")}],
        },
        "epoch": 3,
        "count": torch.tensor(41, dtype=torch.int64),
    }


def global_state() -> dict[str, Any]:
    """The state as one tensor per name (the shards put together)."""
    s0, s1 = rank_state(0), rank_state(1)
    s0["model"]["layers.0.attn.w"] = torch.cat(
        [s0["model"]["layers.0.attn.w"], s1["model"]["layers.0.attn.w"]]
    )
    return s0


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """What the zarr view shows for a tensor (bf16 as its raw uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def save_step(url: str, step: int = 1, job: str = JOB) -> None:
    ckpts = [Checkpointer(url, job, rank=r, world_size=2, chunk_size=CHUNK) for r in range(2)]
    try:
        handles = [
            c.save(step, rank_state(r),
                   shards={"model.layers.0.attn.w": Shard((64, 96), (32 * r, 0))})
            for r, c in enumerate(ckpts)
        ]
        states = [h.wait(timeout=60).state for h in handles]
        assert "committed" in states
    finally:
        for c in ckpts:
            c.close()


@pytest.fixture
def file_step(tmp_path: Path) -> str:
    """A file:// store holding step 1 of job ``zv``; its URL."""
    url = f"file://{tmp_path / 'store'}"
    save_step(url)
    return url
