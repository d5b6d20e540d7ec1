"""A nanoGPT-shaped training run (a small GPT, DDP, gloo, AdamW, a cosine LR
schedule, dropout, random batches) whose checkpointing is exactly the README's
"Use it in a training loop" block: the block is read from README.md and run as
written, with ``model``, ``optimizer``, ``scheduler``, ``train_step``, ``rank``,
``world`` and ``steps`` defined here. Every random draw comes from the global
generators, so only a restore that brings them back (``RNGState``) ends bitwise.

argv: out_dir, then options (see ``main``). Writes ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import math
import os
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ckptd.client.distributed import init_process_group

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_loop() -> str:
    """The python block of the README's "Use it in a training loop" section."""
    text = README.read_text()
    section = text.split("## Use it in a training loop", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README has no python block in its training-loop section"
    return match.group(1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))
        self.heads = heads
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=0.1 if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, d)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, ctx: int = 16, d: int = 32, layers: int = 2,
                 heads: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, ctx, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as nanoGPT does
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(optimizer.state_dict()["state"].items()):
        for key, t in sorted(st.items()):
            h.update(f"{pid}.{key}".encode())
            if isinstance(t, torch.Tensor):
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=230)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--per-rank-buffer", action="store_true",
                        help="a per-rank model buffer the README's loop does not name local")
    args = parser.parse_args()
    out = Path(args.out)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR and record.name.startswith("ckptd"):
                errors.append(record.getMessage())

    logging.getLogger("ckptd").addHandler(Collect())

    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(1234)
    model = GPT()
    ddp: nn.Module
    if args.per_rank_buffer:
        # Ranks train alike (no collectives: a rank that stops early must not hang
        # the other), but one buffer differs between them and is not named local.
        model.register_buffer("tokens_seen", torch.full((4,), float(rank)))
        torch.manual_seed(1000)
        ddp = model
    else:
        torch.manual_seed(1000 + rank)  # batches and dropout differ between ranks
        ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / 300)))
    ns: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                          "rank": rank, "world": world, "steps": args.steps}

    def train_step() -> torch.Tensor:
        step = ns["step"]
        # Die at the planned step, or later once a save since step 100 committed (a
        # loaded machine may still be uploading it): a kill with nothing newer than
        # step 0 to restore would show little.
        if (attempt == 0 and rank == args.kill_rank and step >= args.kill_at
                and (ns["ckpt"].latest() or 0) >= 100):
            os.kill(os.getpid(), signal.SIGKILL)
        idx = torch.randint(0, 64, (8, 17))
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        scheduler.step()
        # Once, at the planned step or later once step 100 committed (as for the kill).
        if (attempt == 0 and rank == args.nan_rank and step >= args.nan_at
                and not ns.get("nan_reported") and (ns["ckpt"].latest() or 0) >= 100):
            ns["nan_reported"] = True
            return loss.detach() * math.nan  # the loss the loop reports goes NaN
        return loss

    ns["train_step"] = train_step
    result: dict[str, Any] = {"rank": rank, "attempt": attempt}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(readme_loop(), "README.md", "exec"), ns)  # noqa: S102 - the test
        except Exception as exc:
            result["error"] = type(exc).__name__
            result["message"] = str(exc)
    ckpt = ns.get("ckpt")
    if args.per_rank_buffer:
        # Both ranks' snapshots are in the store before either closes: without
        # collectives, a loaded machine let one rank run its 120 steps and close
        # before the other had saved step 0; and a barrier after the loops alone let
        # rank 0 close while rank 1 still uploaded its step 0 (CI): nobody can know
        # then that the step never commits. (A rank's snapshots upload one after
        # another: its last one settled, every one is in.)
        if ckpt is not None:
            ckpt._saver.settle(240)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=240))
    if ckpt is not None:
        closed = ckpt.close()
        result["close"] = {"saves": closed.saves, "failed": closed.failed}
    result["start"] = ns.get("start")
    result["warnings"] = [str(w.message) for w in caught
                          if type(w.message).__name__ == "SnapshotFailureWarning"]
    result["errors_logged"] = errors
    result["digest"] = digest(model, optimizer)
    result["rng"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    result["last_lr"] = scheduler.get_last_lr()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
