"""A relaunch that re-saves a step a dead launch saved on some ranks only: every
rank holds a shard of one global tensor (no replica to compare), filled with a
value each process draws at random, so the two launches' bytes differ.

Launch 1: all ranks save step 5; rank 0 saves step 10 (pending), then rank 1
fails before it does; rank 0 sleeps until its agent restarts it. Launch 2: every
rank restores, draws a new value, saves step 10, and once step 10 committed
restores it; the result says what it saved and what came back.

argv: out_dir, job, mode ("helper": ckptd.client.distributed.init_process_group,
"plain": dist.init_process_group). The Checkpointer gets its rank and world size
from torchrun's environment and its launch id from nobody."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptd.client import Checkpointer, Shard
from ckptd.client.distributed import init_process_group

N = 1024


def main() -> None:
    faulthandler.enable(all_threads=True)
    out, job, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "helper":
        init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    starts = out / f"starts-{rank}"
    with open(starts, "a") as f:
        f.write("x")
    launch = len(starts.read_text())
    ckpt = Checkpointer(job=job, timeout=120)
    shard = {"w": Shard([world * N], [rank * N])}
    value = float(int.from_bytes(os.urandom(3), "little"))  # this process's own bytes

    def state() -> dict[str, Any]:
        return {"w": torch.full((N,), value)}

    def committed(step: int) -> None:
        deadline = time.monotonic() + 60
        while (ckpt.latest() or -1) < step:
            assert time.monotonic() < deadline, f"step {step} never committed"
            time.sleep(0.1)

    if launch == 1:
        ckpt.save(5, state(), shards=shard).wait(60)
        dist.barrier()
        committed(5)
        if rank == 0:
            assert ckpt.save(10, state(), shards=shard).wait(60).state == "pending"
            (out / "rank0-saved-10").write_text(str(value))
            time.sleep(300)  # no collective: its agent restarts it, uncounted
        while not (out / "rank0-saved-10").exists():
            time.sleep(0.05)
        os._exit(1)  # this rank's agent counts a restart; rank 0's does not

    result: dict[str, Any] = {"rank": rank, "launch": launch,
                              "incarnation": ckpt.config.incarnation,
                              "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT")}
    restored = ckpt.restore({"w": torch.zeros(N)}, shards=shard)
    result["restored"] = restored.step
    try:
        ckpt.save(10, state(), shards=shard).wait(60)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["saved"] = value
    dist.barrier()
    committed(10)
    target = {"w": torch.zeros(N)}
    ckpt.restore(target, step=10, shards=shard)
    result["back"] = float(target["w"][0])
    ckpt.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
