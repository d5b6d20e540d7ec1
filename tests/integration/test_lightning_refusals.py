"""Mistakes the plugin now says early and once, as a fresh user's probe met them: a
token that may only read (a full epoch trained, then a 57-line traceback), a
resume from an older checkpoint than the job's newest (an epoch later,
AlreadyCommitted), a Fabric step of None (taken as the next step, where the docs
said it is refused), and a failed background save (logged twice with advice
naming Checkpointer calls, then raised)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import AlreadyCommitted, Forbidden, InvalidRequest
from ckptd.tokens import create_token
from tests.conftest import ServerProcess

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("lightning", reason="pip install 'ckptd[lightning]'")

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckptd.client.integrations.lightning import CkptdCheckpointIO  # noqa: E402
from ckptd.client.integrations.lightning.failures import in_lightning_terms  # noqa: E402
from tests.integration.lightning_fixtures import (  # noqa: E402,F401 - *_fixture: found by pytest
    io_fixture,
    small_checkpoint,
    store_fixture,
)

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(name="tenants")
def tenants_fixture(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    """A server with a read and a write token on ``lt-*``."""
    tokens_file = tmp_path / "tokens.json"
    tokens = {role: create_token(tokens_file, "lt-*", role)[0] for role in ("read", "write")}
    srv = ServerProcess(store=tmp_path / "store", token="ADMIN-token",
                        extra_args=["--tokens-file", str(tokens_file)])
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def test_a_read_token_is_refused_where_the_plugin_is_built(
        tenants: tuple[ServerProcess, dict[str, str]], shm: Path, tmp_path: Path) -> None:
    """It was accepted without a word, and the run failed after an epoch of
    training. A plugin built only to load takes it."""
    srv, tokens = tenants
    writer = CkptdCheckpointIO(srv.url, job="lt-a", token=tokens["write"], shm_dir=str(shm))
    writer.save_checkpoint(small_checkpoint(4), tmp_path / "last.ckpt")
    writer.teardown()
    with pytest.raises(Forbidden) as err:
        CkptdCheckpointIO(srv.url, job="lt-a", token=tokens["read"], shm_dir=str(shm))
    message = err.value.message
    assert "\n" not in message and "may read job lt-a but not write it" in message, message
    assert "--role write" in message and "load_only=True" in message, message
    reader = CkptdCheckpointIO(srv.url, job="lt-a", token=tokens["read"], shm_dir=str(shm),
                               load_only=True)
    try:
        assert reader.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4
        with pytest.raises(InvalidRequest, match="load_only=True and only loads"):
            reader.save_checkpoint(small_checkpoint(8), tmp_path / "x.ckpt")
    finally:
        reader.teardown()


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(store: str, shm: Path, root: Path, epochs: int, resume: str | None) -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        plugins=[CkptdCheckpointIO(store, job="lt1", shm_dir=str(shm))],
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=root, save_last=True, save_top_k=-1)])
    trainer.fit(_Tiny(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=4), ckpt_path=resume)


def test_a_resume_from_an_older_step_is_refused_at_its_first_save(store: str, shm: Path,
                                                                  tmp_path: Path) -> None:
    """fit(ckpt_path=<epoch 0's file>) in a job with steps up to 12: the first save
    (step 8) failed in the background, AlreadyCommitted, raised an epoch later.
    Now the first save refuses, before it stores anything, saying what to do."""
    root = tmp_path / "ck"
    _fit(store, shm, root, 3, None)
    with pytest.raises(InvalidRequest) as err:
        _fit(store, shm, root, 3, str(root / "epoch=0-step=4.ckpt"))
    message = err.value.message
    assert "committed steps up to 12" in message and "resumed from step 4" in message, message
    assert "saving step 8" in message and "ckpt_path='latest'" in message, message
    assert "new job=" in message and "\n" not in message, message


def test_a_fabric_step_of_none_is_refused(io: CkptdCheckpointIO, tmp_path: Path) -> None:
    """None became the step after the job's latest; the docs say only whole numbers
    are steps, and that a state without one takes the next step."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    with pytest.raises(InvalidRequest, match=r"checkpoint\['step'\] is None: the ckptd step "
                                             r"of a checkpoint is a whole number"):
        fabric.save(tmp_path / "a.ckpt", {"w": torch.ones(2), "step": None})
    fabric.save(tmp_path / "b.ckpt", {"w": torch.ones(2)})  # no step: the next one, 0
    io.teardown()
    assert io.load_checkpoint("latest")["w"].tolist() == [1.0, 1.0]


def test_a_failed_save_is_said_once_in_lightnings_terms(
        store: str, shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A step the job holds with other bytes, saved again: the Checkpointer's log
    line (advice: 'the next save(), step() or close() raises this error, unless
    handle.wait() raised it') and the plugin's own came before the raise."""
    first = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    first.save_checkpoint(small_checkpoint(4, seed=1), tmp_path / "a.ckpt")
    first.teardown()
    again = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    again.save_checkpoint(small_checkpoint(6, seed=2), tmp_path / "c.ckpt")
    caplog.set_level(logging.INFO, logger="ckptd")
    again.save_checkpoint(small_checkpoint(4, seed=2), tmp_path / "b.ckpt")
    with pytest.raises(AlreadyCommitted) as err:
        again.teardown()
    said = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "step 4" in r.getMessage()]
    assert said == [], said
    message = err.value.message
    assert message.startswith("save of lit step 4 rank 0 failed"), message
    assert "ckpt_path='latest'" in message and "new job=" in message, message
    assert "handle.wait()" not in message and "step()" not in message, message
    again.teardown()  # (Lightning's error path calls it again: nothing more to say)


def test_a_write_token_rotates_top_k_without_failing_the_run(
        tenants: tuple[ServerProcess, dict[str, str]], shm: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """(Found by a probe.) Removing a tag needs admin on the job: a run with the
    write token the docs advise failed at teardown when top-k let a checkpoint go,
    advising a token "of role write" that it had. The pointer goes, the tag stays
    (said once, with the role that would let it go), and the run ends well."""
    srv, tokens = tenants
    io = CkptdCheckpointIO(srv.url, job="lt-k", token=tokens["write"], shm_dir=str(shm))
    paths = [tmp_path / f"epoch={i}-step={4 * (i + 1)}.ckpt" for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="ckptd.client.integrations.lightning"):
        for i, path in enumerate(paths):
            io.save_checkpoint(small_checkpoint(4 * (i + 1)), path)
            if i:
                io.remove_checkpoint(paths[i - 1])
        io.teardown()  # (it raised Forbidden)
    assert [p.exists() for p in paths] == [False, False, True]
    said = [r.getMessage() for r in caplog.records if "stays" in r.getMessage()]
    assert len(said) == 1 and "--role admin" in said[0] and "lt-k" in said[0], said
    refused = in_lightning_terms(Forbidden("this token (write on 'lt-*') may not admin job "
                                           "'lt-k'", needs="admin", job="lt-k"),
                                 "lt-k", srv.url)
    assert "--role admin" in refused.message and "--role write" not in refused.message
