"""One torchrun agent, launched twice by hand with the same ``--rdzv-id`` (a
scheduler or a Kubernetes pod restart running the same command; ``--max-restarts``
0, so each launch is attempt 0), and no process group (the README's loop as it
stands): the second launch re-saves a step the first saved on rank 0 only. Each
rank's shard is one value the process draws at random, so the launches' bytes
differ.

Launch 1: both ranks save step 5; rank 0 saves step 10 (pending), then rank 1
fails and torchrun ends the launch. Launch 2: every rank restores, draws a new
value, saves step 10, and restores it once it committed; the result says what it
saved and what came back. Ranks meet through files in ``out_dir``.

argv: out_dir, job."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ckptd.client import Checkpointer, Shard

N = 1024


def main() -> None:
    out, job = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    starts = out / f"starts-{rank}"
    with open(starts, "a") as f:
        f.write("x")
    launch = len(starts.read_text())
    ckpt = Checkpointer(job=job, timeout=120, serve_peers=False)
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
        committed(5)
        if rank == 0:
            assert ckpt.save(10, state(), shards=shard).wait(60).state == "pending"
            (out / "rank0-saved-10").write_text(str(value))
            time.sleep(300)  # torchrun ends it when rank 1 fails
        while not (out / "rank0-saved-10").exists():
            time.sleep(0.05)
        os._exit(1)

    result: dict[str, Any] = {"rank": rank, "launch": launch,
                              "incarnation": ckpt.config.incarnation}
    result["restored"] = ckpt.restore({"w": torch.zeros(N)}, shards=shard).step
    try:
        ckpt.save(10, state(), shards=shard).wait(60)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["saved"] = value
    try:
        committed(10)
        target = {"w": torch.zeros(N)}
        ckpt.restore(target, step=10, shards=shard)
        result["back"] = float(target["w"][0])
        ckpt.close()
    except Exception as exc:
        result.setdefault("error", f"{type(exc).__name__}: {exc}")
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
