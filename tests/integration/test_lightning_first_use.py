"""``CkptdCheckpointIO`` as a new user meets it (a probe's findings): a load right
after a save reads that save, mistakes in the plugin's arguments are said where
they are given, Fabric steps that are not plain ints, a background failure raised
once, what the pointer says about ``load_from_checkpoint``, and the messages of a
load that finds nothing."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import (
    AlreadyCommitted,
    CheckpointNotFound,
    CkptdError,
    InvalidRequest,
    Timeout,
)
from tests.conftest import ServerProcess

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("lightning", reason="pip install 'ckptd[lightning]'")

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckptd.client.integrations.lightning import CkptdCheckpointIO, read_pointer  # noqa: E402
from ckptd.client.integrations.lightning.rank_zero import RankZeroSaves  # noqa: E402
from tests.integration.lightning_fixtures import (  # noqa: E402,F401 - *_fixture: found by pytest
    assert_same,
    io_fixture,
    rank_one_fixture,
    small_checkpoint,
    store_fixture,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _fabric(io: CkptdCheckpointIO) -> Any:
    return L.Fabric(accelerator="cpu", devices=1, plugins=[io])


def test_a_load_right_after_a_save_reads_that_save(server: ServerProcess, shm: Path,
                                                   tmp_path: Path) -> None:
    """It read the pointer's older step (the pointer is rewritten once the new step
    commits), and a new path was CheckpointNotFound: a load now waits for the saves
    in flight, as torch.load after torch.save reads what was saved."""
    io = CkptdCheckpointIO(server.url, job="fr", shm_dir=str(shm))
    try:
        fabric = _fabric(io)
        path = tmp_path / "fr" / "last.ckpt"
        fabric.save(path, {"w": torch.full((3,), 1.0), "step": 1})
        fabric.save(path, {"w": torch.full((3,), 2.0), "step": 2})
        state = {"w": torch.zeros(3)}
        assert fabric.load(path, state) == {"step": 2}
        assert torch.equal(state["w"], torch.full((3,), 2.0))
        fabric.save(tmp_path / "fr" / "new.ckpt", {"w": torch.full((3,), 3.0), "step": 3})
        state = {"w": torch.zeros(3)}
        assert fabric.load(tmp_path / "fr" / "new.ckpt", state) == {"step": 3}
        assert torch.equal(state["w"], torch.full((3,), 3.0))
        # A save that fails is said by the load that waited for it.
        fabric.save(tmp_path / "fr" / "again.ckpt", {"w": torch.full((3,), 9.0), "step": 2})
        with pytest.raises(AlreadyCommitted, match="save of fr step 2 rank 0 failed"):
            fabric.load(tmp_path / "fr" / "again.ckpt", {"w": torch.zeros(3)})
    finally:
        io.teardown()


@pytest.mark.parametrize(("url", "says"), [
    ("127.0.0.1:18471", "did you mean http://127.0.0.1:18471?"),
    ("localhost:8470", "did you mean http://localhost:8470?"),
    ("ckptd:8470", "did you mean http://ckptd:8470?"),
    ("relative/store", "is a path, not a URL: a directory store is file:///"),
    ("file://store/x", "must name a local directory as file:///absolute/path"),
    ("http://127.0.0.1:18471/v1", "has a path or query"),
    ("ftp://host/x", "unsupported URL"),
])
def test_a_malformed_url_is_said_at_construction(url: str, says: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's host:port without its scheme was accepted and failed at the
    first save, after an epoch of training."""
    monkeypatch.setenv("CKPTD_SERVER_WAIT", "0")
    with pytest.raises(InvalidRequest, match=says.replace("?", r"\?").replace(".", r"\.")) as err:
        CkptdCheckpointIO(url, job="lit")
    assert "\n" not in err.value.message


def test_an_unknown_checkpointer_keyword_is_named_at_construction(store: str) -> None:
    """shmdir= failed at the first save, with a TypeError about CheckpointerConfig."""
    with pytest.raises(InvalidRequest, match=r"unknown keyword shmdir=: did you mean "
                                             r"shm_dir=\?.*staging_budget") as err:
        CkptdCheckpointIO(store, job="lit", shmdir="/dev/shm")
    assert "\n" not in err.value.message
    with pytest.raises(InvalidRequest, match="rank= is the plugin's"):
        CkptdCheckpointIO(store, job="lit", rank=1)


@pytest.mark.parametrize("timeout", ["60", 0, -1.0, float("nan"), True, [60]])
def test_a_timeout_that_is_not_seconds_is_refused_at_construction(store: str,
                                                                  timeout: Any) -> None:
    """timeout="60" surfaced later as an internal TypeError (and a coroutine never
    awaited, and a staging pool left in /dev/shm)."""
    with pytest.raises(InvalidRequest, match="timeout must be seconds above 0"):
        CkptdCheckpointIO(store, job="lit", timeout=timeout)


def test_a_fabric_step_that_is_a_whole_number_is_the_step(io: CkptdCheckpointIO,
                                                          tmp_path: Path) -> None:
    """500.0 and torch.tensor(600) were replaced by a counter (steps 0 and 1)."""
    fabric = _fabric(io)
    fabric.save(tmp_path / "a.ckpt", {"w": torch.ones(2), "step": 500.0})
    fabric.save(tmp_path / "b.ckpt", {"w": torch.ones(2), "step": torch.tensor(600)})
    io.teardown()
    assert read_pointer(tmp_path / "a.ckpt")["step"] == 500
    assert read_pointer(tmp_path / "b.ckpt")["step"] == 600
    for bad, says in ((700.5, "700.5"), ("700", "'700'"), (-1, "-1"),
                      (torch.tensor(700.0), r"a tensor of shape \(\) and dtype torch.float32"),
                      (torch.tensor([7, 8]), r"a tensor of shape \(2,\)")):
        with pytest.raises(InvalidRequest, match=rf"checkpoint\['step'\] is {says}.*: the "
                                                 "ckptd step of a checkpoint is a whole number"):
            fabric.save(tmp_path / "c.ckpt", {"w": torch.ones(2), "step": bad})
    with pytest.raises(InvalidRequest, match=r"checkpoint\['global_step'\] is 1\.5"):
        io.save_checkpoint({**small_checkpoint(4), "global_step": 1.5}, tmp_path / "d.ckpt")


def test_a_background_failure_is_raised_once(server: ServerProcess, shm: Path,
                                             tmp_path: Path) -> None:
    """The server goes away while a save is in flight: the next save, which waits
    for it, raises its Unavailable; teardown raised it a second time (the plugin's
    background thread met it too, after the save had raised it). The thread is held
    back by a removal of a FIFO (its read blocks until the test writes), so that the
    save, not the thread, sees the failure first."""
    io = CkptdCheckpointIO(server.url, job="lit", shm_dir=str(shm), timeout=60)
    fifo = tmp_path / "held.ckpt"
    os.mkfifo(fifo)
    try:
        io.save_checkpoint(small_checkpoint(4, seed=1), tmp_path / "a.ckpt")
        deadline = time.monotonic() + 60
        while not (tmp_path / "a.ckpt").exists():  # (its pointer: step 4 committed)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        io.remove_checkpoint(fifo)  # the background thread waits in its read
        server.stop()
        io.save_checkpoint(small_checkpoint(6, seed=2), tmp_path / "b.ckpt")
        raised: list[BaseException] = []
        try:
            io.save_checkpoint(small_checkpoint(8, seed=3), tmp_path / "c.ckpt")
        except CkptdError as exc:
            raised.append(exc)
        writer = os.open(fifo, os.O_WRONLY)  # lets the thread go on, to step 6's wait
        os.write(writer, b"not a pointer")
        os.close(writer)
        try:
            io.teardown()
        except CkptdError as exc:
            raised.append(exc)
        assert [type(e).__name__ for e in raised] == ["Unavailable"], raised
        assert "save of lit step 6" in str(raised[0])
    finally:
        with contextlib.suppress(OSError):  # (a failure above left the thread waiting)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        io.teardown()


class _Sized(L.LightningModule):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_is_built_from_a_pointer_as_the_docs_say(store: str, shm: Path,
                                                          tmp_path: Path) -> None:
    """LightningModule.load_from_checkpoint reads the file itself (no CheckpointIO):
    on a pointer, torch's unpickling error. The pointer's "about" says what to do,
    and that way (docs/integrations/lightning.md) gives the trained module."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(16, 3)
    io = CkptdCheckpointIO(store, job="mod", shm_dir=str(shm))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[io], logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path)])
    model = _Sized(hidden=7)
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1]), batch_size=4))
    path = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    about = json.loads(Path(path).read_text())["about"]
    assert "load_checkpoint" in about and "load_from_checkpoint" in about
    assert "hyper_parameters" in about and "load_state_dict" in about
    with pytest.raises(Exception):  # noqa: B017 (torch's error, whatever it says)
        _Sized.load_from_checkpoint(path)
    reader = CkptdCheckpointIO(store, job="mod", shm_dir=str(shm))
    try:
        ckpt = reader.load_checkpoint(path)
        again = _Sized(**ckpt["hyper_parameters"])
        again.load_state_dict(ckpt["state_dict"])
    finally:
        reader.teardown()
    assert again.hparams["hidden"] == 7
    assert_same(dict(model.state_dict()), dict(again.state_dict()))


def test_a_load_that_finds_nothing_says_why(io: CkptdCheckpointIO, tmp_path: Path) -> None:
    """A directory was "no such file"; 'latest' on a fresh job named a tag
    'latest.ckpt' it never asked for."""
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint yet") as err:
        io.load_checkpoint("latest")
    assert "latest.ckpt" not in err.value.message
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint yet"):
        io.load_checkpoint(tmp_path / "latest.ckpt")
    (tmp_path / "ckpts").mkdir()
    with pytest.raises(CheckpointNotFound, match="ckpts is a directory, not a checkpoint file"):
        io.load_checkpoint(tmp_path / "ckpts")


@pytest.mark.timeout(60)
def test_a_load_on_another_rank_says_when_rank_0s_saves_do_not_finish(
        rank_one: RankZeroSaves, store: str, shm: Path, tmp_path: Path) -> None:
    """Rank 0 queued a save that does not finish within the plugin's timeout (its
    upload is slow, its server stalls): a load on rank 1 waits that long, not
    forever, and raises Timeout in a line that says what to do."""
    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm), timeout=0.5)
    rank_one.queued()  # (as rank 0's plugin counts a save it queued)
    try:
        began = time.monotonic()
        with pytest.raises(Timeout) as err:
            io.load_checkpoint(tmp_path / "last.ckpt")
        assert 0.5 <= time.monotonic() - began < 10
        assert err.value.message == (
            f"{tmp_path / 'last.ckpt'}: global rank 0's saves before this load did not "
            "finish within 0.5 s; loading now would read an older checkpoint, or none "
            "(pass a larger timeout= to CkptdCheckpointIO)")
        rank_one.done()  # finished late: the next load waits no more (nothing there)
        with pytest.raises(CheckpointNotFound):
            io.load_checkpoint(tmp_path / "last.ckpt")
    finally:
        io.teardown()


@pytest.mark.timeout(60)
def test_teardown_on_another_rank_waits_for_rank_0s_saves(
        rank_one: RankZeroSaves, store: str, shm: Path, tmp_path: Path) -> None:
    """Lightning calls teardown on every rank when fit ends; test(ckpt_path="last")
    then picks its file on each rank from what it sees. Rank 1's teardown returned
    at once, so when fit's last save wrote the first last.ckpt, rank 1 found none
    (it loaded nothing). It now returns once rank 0 finished the saves it queued."""
    last = tmp_path / "last.ckpt"

    def rank_0_background() -> None:  # (its upload, then its pointer, then the count)
        time.sleep(0.3)
        last.write_text("{}")
        rank_one.done()

    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm), timeout=30)
    rank_one.queued()
    thread = threading.Thread(target=rank_0_background)
    thread.start()
    try:
        io.teardown()
        assert last.exists()
    finally:
        thread.join()


@pytest.mark.timeout(60)
def test_teardown_on_another_rank_says_when_rank_0s_saves_do_not_finish(
        rank_one: RankZeroSaves, store: str, shm: Path) -> None:
    """Bounded by the plugin's timeout, a Timeout that says what to do; Lightning's
    error path then calls teardown again, which does not wait a second time."""
    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm), timeout=0.5)
    rank_one.queued()
    began = time.monotonic()
    with pytest.raises(Timeout) as err:
        io.teardown()
    assert 0.5 <= time.monotonic() - began < 10
    assert err.value.message == (
        "job lit: rank 1's teardown waited 0.5 s for global rank 0's saves, which did not "
        "finish; a load or a validate/test with ckpt_path= that follows may read an older "
        "checkpoint, or none: pass a larger timeout= to CkptdCheckpointIO (rank 0's log "
        "says why its saves are slow)")
    began = time.monotonic()
    io.teardown()
    assert time.monotonic() - began < 0.25
