"""A Lightning ``Trainer`` on 2 DDP ranks (gloo, CPU) checkpointing through
``CkptdCheckpointIO``: ``ModelCheckpoint`` saves every epoch (and ``last``), and
``fit(ckpt_path="last")`` resumes from the pointer Lightning finds. With
``--kill-rank R --kill-epoch E`` rank R SIGKILLs itself early in epoch E of the
first launch, once ``last`` names the step before it (committed), for torchrun to
restart both ranks.

With ``--load-after-save``, after ``fit`` a ``Fabric`` on the same plugin saves
two steps in turn at one path and loads each back on every rank at once; then a
one-epoch ``fit`` whose only save writes its directory's first ``last.ckpt`` is
followed by ``test(ckpt_path="last")`` on every rank.

argv: out_dir url job workdir [--kill-rank R --kill-epoch E] [--load-after-save].
Writes ``<out>/rank<r>.json``: the launch, the step training started from, digests
of the model and the optimizer state, and what each load after a save read."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from ckptd.client.distributed import init_process_group
from ckptd.client.integrations.lightning import CkptdCheckpointIO, read_pointer

EPOCHS = 4
BATCHES = 4  # per rank and epoch: global_step grows by 4 each epoch


def digest(value: Any) -> str:
    h = hashlib.blake2b()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(path.encode())
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in x:
                walk(x[k], f"{path}/{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        else:
            h.update(f"{path}={x!r}".encode())

    walk(value, "")
    return h.hexdigest()


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class Watch(Callback):
    """Notes where training started, and kills a rank when asked."""

    def __init__(self, rank: int, kill_rank: int | None, kill_epoch: int | None,
                 last: Path) -> None:
        self.rank = rank
        self.kill_rank, self.kill_epoch = kill_rank, kill_epoch
        self.last = last
        self.start_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (not first_launch or self.rank != self.kill_rank
                or trainer.current_epoch != self.kill_epoch or batch_idx != 1):
            return
        want = self.kill_epoch * BATCHES
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the step before is committed: last names it
            doc = read_pointer(self.last) if self.last.exists() else None
            if doc is not None and doc["step"] == want:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{self.last} never named step {want}")
        os.kill(os.getpid(), signal.SIGKILL)


def load_after_save(io: CkptdCheckpointIO, path: Path) -> list[Any]:
    """``fabric.save`` (global rank 0 saves, then every rank meets at a barrier) and
    ``fabric.load`` at once (every rank loads): the step each load read, or its
    error's name. The state is large enough for rank 0's upload to outlast another
    rank's look at the pointer: the first save finds no pointer there, the second
    the first one's."""
    fabric = L.Fabric(accelerator="cpu", devices=2, plugins=[io],
                      strategy=FabricDDP(process_group_backend="gloo"))
    fabric.launch()
    big = torch.arange(8 * 2**20, dtype=torch.float32)  # 32 MiB
    read: list[Any] = []
    for step in (100, 101):
        fabric.save(path, {"step": step, "w": big + step})
        try:
            got = fabric.load(path)
            read.append(got["step"] if torch.equal(got["w"], big + got["step"]) else "bits")
        except Exception as exc:
            read.append(type(exc).__name__)
            fabric.barrier()  # (the one fabric.load meets after its load)
        fabric.barrier()
    return read


class Tested(Regressor):
    """Saves a tensor large enough for rank 0's upload to outlast another rank's
    look for ``last.ckpt``; notes the step each load gave it."""

    big = torch.arange(8 * 2**20, dtype=torch.float32)  # 32 MiB

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[Any] = []

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["big"] = self.big + checkpoint["global_step"]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        step = checkpoint["global_step"]
        self.loaded.append(step if torch.equal(checkpoint["big"], self.big + step) else "bits")


def test_last_after_fit(url: str, job: str, workdir: Path, loader: DataLoader[Any]) -> list[Any]:
    """``fit`` for one epoch (its end writes the first ``last.ckpt``), then
    ``test(ckpt_path="last")``: the steps each rank's test loaded (none when it found
    no ``last.ckpt``, which Lightning looks for on each rank before any barrier)."""
    io = CkptdCheckpointIO(url, job=job, shm_dir=str(workdir / "shm"), timeout=60.0)
    model = Tested()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, max_epochs=1,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, callbacks=[ModelCheckpoint(dirpath=workdir / "test-checkpoints",
                                                       save_top_k=0, save_last=True)],
    )
    trainer.fit(model, loader)
    trainer.test(model, loader, ckpt_path="last", verbose=False)
    return model.loaded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("url")
    p.add_argument("job")
    p.add_argument("workdir")
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-epoch", type=int)
    p.add_argument("--load-after-save", action="store_true")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    # Lightning uses a process group that exists already: this one keeps each torchrun
    # attempt's keys apart (a restarted attempt otherwise meets the dead one's gloo
    # addresses in the agent's store and fails to connect).
    init_process_group("gloo", timeout=timedelta(seconds=60))
    workdir = Path(args.workdir)
    ckpts = workdir / "checkpoints"

    torch.manual_seed(0)
    x = torch.randn(2 * BATCHES * 8, 16)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(len(x), 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    model = Regressor()

    io = CkptdCheckpointIO(args.url, job=args.job, shm_dir=str(workdir / "shm"), timeout=60.0)
    watch = Watch(rank, args.kill_rank, args.kill_epoch, ckpts / "last.ckpt")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, max_epochs=EPOCHS,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_epochs=1, save_top_k=-1,
                                   save_last=True), watch],
    )
    trainer.fit(model, loader, ckpt_path="last")
    result = {
        "rank": rank,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "start": watch.start_step,
        "global_step": trainer.global_step,
        "model": digest(model.state_dict()),
        "optim": digest(trainer.optimizers[0].state_dict()),
    }
    if args.load_after_save:
        result["load_after_save"] = load_after_save(io, ckpts / "fabric.ckpt")
        result["test_last"] = test_last_after_fit(args.url, f"{args.job}-test", workdir, loader)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # As torch asks of every script that made a group: a gloo group left for the
    # interpreter's exit to destroy once aborted a clean rank (SIGABRT, "terminate
    # called without an active exception") after fit had ended.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
