"""The README's training loop on one node of a multi-node torchrun job: the
nanoGPT-shaped model of tests/e2e/workers/readme_loop.py (imported from there),
the README's "Use it in a training loop" block run as written, and marks of what
happened when, so a test can act at a precise step and a benchmark can take a
recovery apart.

argv: out_dir, then options (see ``main``). Every process appends its events to
``<out>/events.jsonl`` (one JSON line each: wall time, host, rank, pid, event);
the process that finishes a rank writes ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from readme_loop import GPT, digest, readme_loop  # tests/e2e/workers, on PYTHONPATH
from torch import nn

from ckptd.client import Checkpointer
from ckptd.client.distributed import init_process_group
from ckptd.errors import CkptdError


def process_started() -> float:
    """When this process was forked, as wall-clock time (/proc, 10 ms ticks): the
    moment its agent's rendezvous had completed and it started the workers."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # field 22 of stat; two fields precede the split point
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class Marks:
    """Appends events to the run's events.jsonl; one line per write (O_APPEND)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "events.jsonl"
        self.base = {"host": socket.gethostname(), "pid": os.getpid(),
                     "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                     "rank": int(os.environ.get("RANK", "-1"))}

    def __call__(self, event: str, t: float | None = None, **fields: Any) -> None:
        line = json.dumps({"t": time.time() if t is None else t, "event": event,
                           **self.base, **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def timed_checkpointer(mark: Marks, model: nn.Module, optimizer: torch.optim.Optimizer,
                       before_save: Callable[[int], None] | None = None) -> None:
    """Marks when the README's Checkpointer is ready, what its restore did, and
    every save (with the digest of what it saved), without changing what they do."""
    init, restore, save = Checkpointer.__init__, Checkpointer.restore, Checkpointer.save

    def timed_init(self: Checkpointer, *args: Any, **kwargs: Any) -> None:
        start = time.time()
        policy = os.environ.get("CKPTD_TEST_HEALTH_POLICY")
        if policy:  # (a scenario whose outcome a probe's snapshot would change)
            kwargs.setdefault("health_policy", policy)
        init(self, *args, **kwargs)
        mark("checkpointer_ready", began=start, rank_seen=self.rank, world_seen=self.world_size)

    def timed_restore(self: Checkpointer, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = restore(self, *args, **kwargs)
        mark("restored", began=start, step=result.step, seconds=result.seconds,
             bytes_from=dict(result.bytes_from), bytes=result.bytes_restored,
             digest=digest(model, optimizer),
             problems=[str(p) for p in result.problems])
        return result

    def timed_save(self: Checkpointer, step: int, state: Any, **kwargs: Any) -> Any:
        mark("save", step=step, digest=digest(model, optimizer),
             reason=(kwargs.get("meta") or {}).get("reason"))
        if before_save is not None:
            before_save(step)
        return save(self, step, state, **kwargs)

    setattr(Checkpointer, "__init__", timed_init)  # noqa: B010 - wrapped, not replaced
    setattr(Checkpointer, "restore", timed_restore)  # noqa: B010
    setattr(Checkpointer, "save", timed_save)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=130)
    parser.add_argument("--pause-host", default="",
                        help="this host's first rank stops at step --pause-at once a step "
                             ">= --pause-after committed, says so, and waits for 'go-on'")
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-after", type=int, default=100)
    parser.add_argument("--pause-in", choices=("step", "save"), default="step",
                        help="stop before training that step, or inside its save() before "
                             "anything is staged (the other ranks save it)")
    parser.add_argument("--mark-steps", default="",
                        help="comma-separated steps whose start every rank marks")
    parser.add_argument("--width", type=int, default=32,
                        help="the model's width (d_model); the state grows with its square")
    parser.add_argument("--pg-timeout", type=float, default=60.0,
                        help="the process group's timeout: how long a rank waits on a "
                             "peer that went silent")
    args = parser.parse_args()
    out = Path(args.out)
    mark = Marks(out)
    mark("started", t=process_started())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mark.base["rank"] = rank
    mark("group_ready", world=world)
    host = socket.gethostname()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(1234)
    model = GPT(d=args.width)
    torch.manual_seed(1000 + rank)  # batches and dropout differ between ranks
    # DDP rebuilds its gradient buckets after its first iteration, in the order
    # gradients became ready: a restarted job's first steps then sum each gradient
    # over 4 ranks in another order than the undisturbed run did at those steps,
    # and floating point sums differ in the last bits (2 ranks commute; 4 do not).
    # find_unused_parameters=True keeps the first layout for good (torch's
    # Reducer::should_rebuild_buckets), so a restart trains exactly as before.
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / 300)))
    mark("model_ready")
    ns: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                          "rank": rank, "world": world, "steps": args.steps}
    marked = {int(s) for s in args.mark_steps.split(",") if s}
    paused = out / "paused"
    slowest = [0.0, -1]
    last = [time.time(), False]

    def pausing(step: int, where: str) -> bool:
        return (where == args.pause_in and host == args.pause_host and local_rank == 0
                and step >= args.pause_at and not paused.exists())

    def pause_here(step: int) -> None:
        ckpt = ns["ckpt"]
        deadline = time.monotonic() + 120
        while (ckpt.latest() or -1) < args.pause_after and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(FileExistsError):
            fd = os.open(paused, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            os.write(fd, f"{host} {rank} {step}".encode())
            os.close(fd)
            mark("paused", step=step, latest=ckpt.latest())
            while not (out / "go-on").exists():  # until the test releases it, or kills it
                time.sleep(0.05)
            mark("released", step=step)

    def train_step() -> torch.Tensor:
        step = ns["step"]
        now = time.time()
        if last[1]:  # the time since the last step ended: a stall shows here
            gap = now - float(last[0])
            if gap > slowest[0]:
                slowest[0], slowest[1] = gap, step
        if step in marked:
            mark("step", step=step)
        if pausing(step, "step"):
            pause_here(step)
        idx = torch.randint(0, 64, (8, 17))
        optimizer.zero_grad(set_to_none=True)
        loss: torch.Tensor = ddp(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        scheduler.step()
        if not last[1]:
            mark("first_step", step=step)
        last[0], last[1] = time.time(), True
        return loss

    ns["train_step"] = train_step
    timed_checkpointer(mark, model, optimizer,
                       lambda step: pause_here(step) if pausing(step, "save") else None)
    result: dict[str, Any] = {"rank": rank, "world": world, "host": host}
    try:
        exec(compile(readme_loop(), "README.md", "exec"), ns)  # noqa: S102 - the test
    except CkptdError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    except Exception as exc:
        # A peer gone mid-collective: end this worker, so that its agent restarts the group.
        mark("failed", error=type(exc).__name__, message=str(exc)[:300],
             step=ns.get("step"))
        raise
    ckpt = ns.get("ckpt")
    if ckpt is not None:
        closed = ckpt.close()
        result["close"] = {"saves": closed.saves, "failed": closed.failed}
    mark("finished", slowest_gap=slowest[0], slowest_at=slowest[1])
    result.update(start=ns.get("start"), digest=digest(model, optimizer),
                  rng=hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
                  last_lr=scheduler.get_last_lr(), slowest_gap=slowest[0])
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
