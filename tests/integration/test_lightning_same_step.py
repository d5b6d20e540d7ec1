"""One step saved under two names (a top-k file, then ``last.ckpt``), as a fresh
user's probe met it: a tensor made anew at each save (``on_save_checkpoint``,
``AsyncCheckpointIO``'s clones) with the same bytes is the same step, not a
``Conflict``; and a run resumed from its first checkpoint goes on writing
``last.ckpt``, not ``last-v1.ckpt``."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import Conflict

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("lightning", reason="pip install 'ckptd[lightning]'")

import lightning as L  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckptd.client.integrations.lightning import CkptdCheckpointIO, read_pointer  # noqa: E402
from ckptd.client.integrations.lightning.tags import JobTags  # noqa: E402
from tests.integration.lightning_fixtures import (  # noqa: E402,F401 - *_fixture: found by pytest
    io_fixture,
    small_checkpoint,
    store_fixture,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _tags(store: str, job: str) -> dict[str, int]:
    tags = JobTags(store, None, job)
    try:
        return tags.all()
    finally:
        tags.close()


class _Seen(L.LightningModule):
    """The probe's module: ``on_save_checkpoint`` puts a new tensor in each save.
    Its weight is larger than the tensors the plugin keeps by reference."""

    def __init__(self, seen: bool = True) -> None:
        super().__init__()
        self.seen = seen
        self.net = torch.nn.Linear(200, 100)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x)[:, :1], y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.seen:
            checkpoint["seen"] = torch.tensor(float(self.global_step))


def _fit(plugin: Any, root: Path, epochs: int, resume: str | None = None,
         seen: bool = True) -> L.Trainer:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(16, 200)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=[plugin],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root,
                                                                       save_last=True)])
    trainer.fit(_Seen(seen), DataLoader(TensorDataset(x, x[:, :1]), batch_size=4), ckpt_path=resume)
    return trainer


def test_a_new_tensor_with_the_same_bytes_names_the_same_step(store: str, shm: Path,
                                                              tmp_path: Path) -> None:
    """It was a Conflict at the end of epoch 0 ("tensor '/seen' is not the one it
    holds"): the second name of a step was compared by tensor identity."""
    _fit(CkptdCheckpointIO(store, job="seen", shm_dir=str(shm)), tmp_path / "ck", 2)
    assert read_pointer(tmp_path / "ck" / "last.ckpt")["step"] == 8  # type: ignore[index]
    assert _tags(store, "seen") == {"epoch_1-step_8": 8, "last": 8}


def test_async_checkpoint_io_clones_name_the_same_step(store: str, shm: Path,
                                                       tmp_path: Path) -> None:
    """Lightning's AsyncCheckpointIO clones every tensor at each save: last.ckpt was
    a Conflict on the model's weight, and no last.ckpt was ever written. (The
    wrapper's teardown does not call the plugin's: the test calls it, as the docs
    say to.)"""
    io = CkptdCheckpointIO(store, job="clone", shm_dir=str(shm))
    _fit(AsyncCheckpointIO(io), tmp_path / "ck", 1)
    io.teardown()
    assert read_pointer(tmp_path / "ck" / "last.ckpt")["step"] == 4  # type: ignore[index]
    assert _tags(store, "clone") == {"epoch_0-step_4": 4, "last": 4}


def test_other_bytes_at_a_step_saved_are_still_a_conflict(io: CkptdCheckpointIO,
                                                          tmp_path: Path) -> None:
    """Copies compare by bytes, both a small tensor (kept by reference) and a large
    one (read back from the stored step): equal ones tag it, others are refused."""
    checkpoint = small_checkpoint(4)
    checkpoint["state_dict"]["big"] = torch.arange(40_000, dtype=torch.float32)
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    io.save_checkpoint(copy.deepcopy(checkpoint), tmp_path / "b.ckpt")
    small = copy.deepcopy(checkpoint)
    small["state_dict"]["weight"][0, 0] += 1
    with pytest.raises(Conflict, match=r"tensor '/state_dict/weight' holds other bytes"):
        io.save_checkpoint(small, tmp_path / "c.ckpt")
    big = copy.deepcopy(checkpoint)
    big["state_dict"]["big"][-1] = -1.0
    with pytest.raises(Conflict, match=r"tensor '/state_dict/big' holds other bytes"):
        io.save_checkpoint(big, tmp_path / "d.ckpt")
    io.teardown()
    assert read_pointer(tmp_path / "b.ckpt")["step"] == 4  # type: ignore[index]
    assert not (tmp_path / "c.ckpt").exists() and not (tmp_path / "d.ckpt").exists()


def test_large_copies_are_compared_by_hash_without_reading_the_step_back(
        io: CkptdCheckpointIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large tensor made anew at the second save (FSDP's full state dict,
    AsyncCheckpointIO's clones) was compared with the whole step read back into
    host memory: a second copy of the model. It is hashed against the stored
    manifest's chunk ids; the step is never read back."""
    checkpoint = small_checkpoint(4)
    checkpoint["state_dict"]["big"] = torch.arange(300_000, dtype=torch.float32)
    checkpoint["state_dict"]["half"] = torch.ones(70_000, dtype=torch.bfloat16)

    def no_read(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the stored step was read back")

    monkeypatch.setattr(CkptdCheckpointIO, "_read", no_read)
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    io.save_checkpoint(copy.deepcopy(checkpoint), tmp_path / "b.ckpt")
    for name, where in (("big", 299_999), ("half", 0)):
        other = copy.deepcopy(checkpoint)
        other["state_dict"][name][where] = -1.0
        with pytest.raises(Conflict, match=rf"tensor '/state_dict/{name}' holds other bytes"):
            io.save_checkpoint(other, tmp_path / f"{name}.ckpt")
    reshaped = copy.deepcopy(checkpoint)
    reshaped["state_dict"]["big"] = reshaped["state_dict"]["big"].reshape(1000, 300)
    with pytest.raises(Conflict, match=r"tensor '/state_dict/big' holds other bytes"):
        io.save_checkpoint(reshaped, tmp_path / "reshaped.ckpt")
    io.teardown()
    assert read_pointer(tmp_path / "b.ckpt")["step"] == 4  # type: ignore[index]


def test_a_run_resumed_from_its_first_checkpoint_keeps_last_ckpt(store: str, shm: Path,
                                                                tmp_path: Path) -> None:
    """The step is stored as its first name saved it, the top-k file, whose
    last_model_path was still "": a run resumed from last.ckpt wrote last-v1.ckpt,
    and last.ckpt (and the tag last) stayed at the old step for good."""
    root = tmp_path / "ck"
    _fit(CkptdCheckpointIO(store, job="doc", shm_dir=str(shm)), root, 1, seen=False)
    assert read_pointer(root / "last.ckpt")["step"] == 4  # type: ignore[index]
    trainer = _fit(CkptdCheckpointIO(store, job="doc", shm_dir=str(shm)), root, 3, "last",
                   seen=False)
    assert trainer.global_step == 12
    assert sorted(p.name for p in root.iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert read_pointer(root / "last.ckpt")["step"] == 12  # type: ignore[index]
    assert _tags(store, "doc") == {"epoch_2-step_12": 12, "last": 12}
