"""What every e2e worker shares: the gloo process group and a result file per rank."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def init() -> tuple[int, int, Path]:
    """Joins the gloo group torchrun describes; (rank, world size, output folder).
    A rank that dies by a signal prints every thread's Python stack first."""
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), Path(sys.argv[1])


def finish(out: Path, rank: int, result: dict[str, Any]) -> None:
    """Writes this rank's result, then leaves the group."""
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


def global_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """The same tensor on every rank (drawn from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equal to NaN), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
