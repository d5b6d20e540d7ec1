"""What every e2e worker shares: the gloo process group and a result file per rank."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def init() -> tuple[int, int, Path]:
    """Joins the gloo group torchrun describes; (rank, world size, output folder).
    A rank that dies by a signal prints every thread's Python stack first."""
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), Path(sys.argv[1])


def finish(out: Path, rank: int, result: dict[str, Any]) -> NoReturn:
    """Writes this rank's result, leaves the group, and ends the process at once.

    Not through the interpreter's own teardown: there torch's gloo worker threads
    can still abort ("terminate called without an active exception") or crash
    after the group was destroyed (pytorch/pytorch#190489 and its kind): one rank
    in a full run did, after every rank had written its result. What is tested
    here is done by then; every ckptd object a worker made is closed before this
    (their ``with`` blocks), so nothing of ckptd's is left to the exit."""
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
