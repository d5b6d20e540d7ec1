"""The demo's training script, one process per rank under torchrun (gloo, CPU).

Deterministic on purpose: the model starts from a fixed seed and each step's batch
comes from a generator seeded by the step, so a run that loses a rank, restores
and carries on ends bitwise where an undisturbed run ends."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ckptd.client import Checkpointer
from ckptd.client.distributed import init_process_group


def log_event(path: Path, **event: object) -> None:
    event["time"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


Trio = tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]


def build(seed: int) -> Trio:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    return model, optimizer, scheduler


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--events", required=True)
    args = parser.parse_args()

    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Path(args.events)

    model, optimizer, scheduler = build(seed=1234)
    ddp = nn.parallel.DistributedDataParallel(model)
    ckpt = Checkpointer(args.url, job=args.job, rank=rank, world_size=world)

    def state() -> dict[str, object]:
        return {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "sched": scheduler.state_dict(),
            "step": step,
        }

    step = 0
    if ckpt.latest() is not None:
        t0 = time.monotonic()
        restored = state()
        result = ckpt.restore(restored)
        model.load_state_dict(restored["model"])  # type: ignore[arg-type]
        optimizer.load_state_dict(restored["optim"])  # type: ignore[arg-type]
        scheduler.load_state_dict(restored["sched"])  # type: ignore[arg-type]
        step = int(restored["step"])  # type: ignore[call-overload]
        log_event(events, kind="restored", rank=rank, attempt=attempt, step=step,
                  bytes=result.bytes_restored, seconds=time.monotonic() - t0)

    pending = None
    while step < args.steps:
        # Die at the planned step, or later if no checkpoint has committed yet (a
        # loaded machine may still be uploading the first one): a failure with
        # nothing to restore would show nothing.
        if (attempt == 0 and rank == args.kill_rank and step >= args.kill_at
                and ckpt.latest() is not None):
            log_event(events, kind="killed", rank=rank, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        scheduler.step()
        step += 1
        if step % args.every == 0 or step == args.steps:
            if pending is not None:
                pending.wait(timeout=120)
            pending = ckpt.save(step, state())
            log_event(events, kind="saved", rank=rank, attempt=attempt, step=step,
                      loss=float(loss.detach()))
    if pending is not None:
        result = pending.wait(timeout=120)
        log_event(events, kind="final", rank=rank, attempt=attempt, step=step,
                  state=result.state, sent=result.bytes_sent,
                  deduplicated=result.bytes_deduplicated)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
