"""``CkptdCheckpointIO`` on its own and under Lightning in one process: paths to
steps and tags, pointer files, a second name of one step, what cannot be stored,
removals, failures raised later, Fabric, and a Trainer over a real ``ckptd serve``
that resumes from ``last`` to the bits of an uninterrupted run."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import (
    AlreadyCommitted,
    CheckpointNotFound,
    Conflict,
    InvalidName,
    InvalidRequest,
    Unavailable,
    UnsupportedValue,
)
from ckptd.lifecycle.tags import check_new_tag
from tests.conftest import ServerProcess, free_port

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("lightning", reason="pip install 'ckptd[lightning]'")

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckptd.client.integrations.lightning import (  # noqa: E402
    POINTER_FORMAT,
    CkptdCheckpointIO,
    read_pointer,
    tag_for_path,
)
from tests.integration.lightning_fixtures import (  # noqa: E402,F401 - *_fixture: found by pytest
    assert_same,
    io_fixture,
    small_checkpoint,
    store_fixture,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _tags(store: str) -> dict[str, int]:
    from ckptd.client.integrations.lightning.tags import JobTags

    tags = JobTags(store, None, "lit")
    try:
        return tags.all()
    finally:
        tags.close()


def test_paths_become_tags() -> None:
    assert tag_for_path("/x/checkpoints/epoch=0-step=10.ckpt") == "epoch_0-step_10"
    assert tag_for_path(Path("last.ckpt")) == "last"
    assert tag_for_path("/x/last-v1.ckpt") == "last-v1"
    assert tag_for_path("/x/.hidden") == "hidden"
    # No tag is named as a ref (the server refuses one): those keep their suffix.
    assert tag_for_path("/x/latest.ckpt") == "latest.ckpt"
    assert tag_for_path("rollback") == "rollback.ckpt"
    assert check_new_tag(tag_for_path("/x/latest.ckpt")) == "latest.ckpt"
    long = tag_for_path("/x/" + "a=b" * 100 + ".ckpt")
    assert len(long) <= 128 and long != tag_for_path("/x/" + "a=b" * 99 + "a_c.ckpt")


def test_a_checkpoint_round_trips_bitwise_with_a_pointer(io: CkptdCheckpointIO, store: str,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "ckpts" / "epoch=1-step=8.ckpt"
    checkpoint = small_checkpoint(8)
    io.save_checkpoint(checkpoint, path)
    io.teardown()  # waits for the commit and the pointer
    doc = read_pointer(path)
    assert doc is not None and doc["format"] == POINTER_FORMAT
    assert (doc["job"], doc["step"]) == ("lit", 8)
    assert json.loads(path.read_text())["url"] == store
    got = io.load_checkpoint(path)
    assert_same(checkpoint, got)
    assert _tags(store) == {"epoch_1-step_8": 8}


def test_a_second_name_of_one_step_tags_it(io: CkptdCheckpointIO, store: str,
                                           tmp_path: Path) -> None:
    checkpoint = small_checkpoint(4)
    io.save_checkpoint(checkpoint, tmp_path / "epoch=0-step=4.ckpt")
    # Lightning's next save at the same step (last.ckpt): its bookkeeping differs.
    key = next(iter(checkpoint["callbacks"]))
    checkpoint["callbacks"][key] = {**checkpoint["callbacks"][key], "last_model_path": "x"}
    io.save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    io.teardown()
    assert _tags(store) == {"epoch_0-step_4": 4, "last": 4}
    assert read_pointer(tmp_path / "last.ckpt")["step"] == 4  # type: ignore[index]
    # A tensor changed in place since is another state: refused, not dropped.
    checkpoint["state_dict"]["weight"].add_(1.0)
    with pytest.raises(Conflict, match="weight"):
        io.save_checkpoint(checkpoint, tmp_path / "other.ckpt")


def test_a_save_at_the_step_loaded_names_it_only_with_its_own_tensors(
        store: str, shm: Path, tmp_path: Path) -> None:
    """After a load of step 5, a save at step 5 is a second name of it only when its
    tensors hold step 5's bytes (in the model's own tensors, as load_state_dict
    leaves them); other tensors at that number are refused, never dropped."""
    first = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    first.save_checkpoint(small_checkpoint(5), tmp_path / "a.ckpt")
    first.teardown()
    resumed = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    try:
        resumed.load_checkpoint(tmp_path / "a.ckpt")
        resumed.save_checkpoint(small_checkpoint(5), tmp_path / "last.ckpt")  # equal, not same
        with pytest.raises(Conflict, match="loaded already .*weight"):
            resumed.save_checkpoint(small_checkpoint(5, seed=1), tmp_path / "b.ckpt")
    finally:
        resumed.teardown()
    assert _tags(store) == {"a": 5, "last": 5}
    assert not (tmp_path / "b.ckpt").exists()


def test_what_cannot_be_stored_is_named(io: CkptdCheckpointIO, tmp_path: Path) -> None:
    checkpoint = small_checkpoint(4)
    checkpoint["hyper_parameters"]["args"] = argparse.Namespace(lr=0.1)
    with pytest.raises(UnsupportedValue, match=r"hyper_parameters.*args.*Namespace"):
        io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(small_checkpoint(4), tmp_path / "x.ckpt", storage_options={"a": 1})


def test_names_without_pointers_and_latest(store: str, shm: Path, tmp_path: Path) -> None:
    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm), pointers=False)
    try:
        io.save_checkpoint(small_checkpoint(4, seed=1), tmp_path / "epoch=0-step=4.ckpt")
        io.save_checkpoint(small_checkpoint(8, seed=2), tmp_path / "epoch=1-step=8.ckpt")
        io.teardown()
        assert not (tmp_path / "epoch=0-step=4.ckpt").exists()
        # Another node: no file, the name is a tag of the job.
        got = io.load_checkpoint("/elsewhere/epoch=0-step=4.ckpt")
        assert_same(small_checkpoint(4, seed=1)["state_dict"], got["state_dict"])
        assert io.load_checkpoint("latest")["global_step"] == 8
        # A latest.ckpt saved before a newer step: 'latest' is still the newest step
        # (found by review: it read latest.ckpt's tag first), latest.ckpt its own.
        io.save_checkpoint(small_checkpoint(9, seed=3), tmp_path / "latest.ckpt")
        io.save_checkpoint(small_checkpoint(12, seed=4), tmp_path / "best.ckpt")
        io.teardown()
        assert io.load_checkpoint("latest")["global_step"] == 12
        assert io.load_checkpoint("/elsewhere/latest.ckpt")["global_step"] == 9
        with pytest.raises(CheckpointNotFound, match="no tag 'nope'"):
            io.load_checkpoint("/elsewhere/nope.ckpt")
    finally:
        io.teardown()


def test_remove_takes_the_pointer_and_the_tag_not_the_data(io: CkptdCheckpointIO, store: str,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "epoch=0-step=4.ckpt"
    io.save_checkpoint(small_checkpoint(4), path)
    io.remove_checkpoint(path)  # queued after the save's pointer
    io.teardown()
    assert not path.exists() and _tags(store) == {}
    assert io.load_checkpoint("latest")["global_step"] == 4  # the data stays
    plain = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, plain)
    io.remove_checkpoint(plain)  # not a pointer: left alone
    io.teardown()
    assert plain.exists()


def test_a_removal_that_overtakes_its_save_leaves_no_pointer_or_tag(
        io: CkptdCheckpointIO, store: str, tmp_path: Path) -> None:
    """Under ``AsyncCheckpointIO`` a save waits in Lightning's queue while the top-k
    removal of its path comes straight through: the removal found no pointer yet,
    did nothing, and every top-k checkpoint kept its pointer and its tag (which
    keeps its step from retention)."""
    old = tmp_path / "epoch=0-step=4.ckpt"
    with concurrent.futures.ThreadPoolExecutor(1) as queue:  # (the wrapper's thread)
        io.remove_checkpoint(old)  # (Lightning's removal, before the queued save arrives)
        queue.submit(io.save_checkpoint, small_checkpoint(4), old).result()
        queue.submit(io.save_checkpoint, small_checkpoint(8),
                     tmp_path / "epoch=1-step=8.ckpt").result()
    io.teardown()
    assert not old.exists() and _tags(store) == {"epoch_1-step_8": 8}
    assert io.load_checkpoint(tmp_path / "epoch=1-step=8.ckpt")["global_step"] == 8
    assert io.load_checkpoint("latest")["global_step"] == 8


def test_a_removal_of_a_path_never_saved_leaves_its_later_save_whole(
        io: CkptdCheckpointIO, store: str, tmp_path: Path) -> None:
    """A removal that found neither pointer nor tag was kept as an early removal for
    good: a save of that name later (on the remover's thread, or after a teardown)
    was left with no pointer and no tag."""
    last = tmp_path / "last.ckpt"
    io.remove_checkpoint(last)  # (no save came yet: it may be queued elsewhere)
    io.save_checkpoint(small_checkpoint(4), last)  # (this thread's own: a new save)
    io.teardown()
    assert read_pointer(last) is not None and _tags(store) == {"last": 4}
    other = tmp_path / "epoch=1-step=8.ckpt"
    io.remove_checkpoint(other)
    io.teardown()  # (the removal's save never came: forgotten here)
    with concurrent.futures.ThreadPoolExecutor(1) as queue:
        queue.submit(io.save_checkpoint, small_checkpoint(8), other).result()
    io.teardown()
    assert read_pointer(other) is not None and _tags(store) == {"last": 4, "epoch_1-step_8": 8}


def test_without_pointers_a_removal_takes_the_tag_of_its_name(store: str, shm: Path,
                                                             tmp_path: Path) -> None:
    """With ``pointers=False`` the tag is a path's only record: a top-k removal left
    it (and every such step kept from retention: a store that only grew)."""
    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm), pointers=False)
    try:
        io.save_checkpoint(small_checkpoint(4), tmp_path / "epoch=0-step=4.ckpt")
        io.save_checkpoint(small_checkpoint(8, seed=1), tmp_path / "epoch=1-step=8.ckpt")
        io.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
        io.teardown()
        assert _tags(store) == {"epoch_1-step_8": 8}
        assert io.load_checkpoint("latest")["global_step"] == 8
    finally:
        io.teardown()


def test_async_checkpoint_io_keeps_the_top_k_only(store: str, shm: Path,
                                                  tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    warnings.filterwarnings("ignore")
    x = torch.randn(32, 8)
    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3,
                        plugins=[AsyncCheckpointIO(io)], logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=tmp_path / "ckpt", save_last=True, save_top_k=1)])
    trainer.fit(_Regressor(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=8))
    io.teardown()  # (AsyncCheckpointIO's own does not reach the plugin it wraps)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert _tags(store) == {"epoch_2-step_12": 12, "last": 12}


def test_a_background_failure_is_raised_by_the_next_call(store: str, shm: Path,
                                                         tmp_path: Path) -> None:
    first = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    first.save_checkpoint(small_checkpoint(4, seed=1), tmp_path / "a.ckpt")
    first.teardown()
    again = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    # A run that loaded nothing and saves a committed step is refused at once
    # (test_a_run_on_a_node_without_the_pointers_says_so_at_its_first_save).
    with pytest.raises(InvalidRequest, match="loaded none of them"):
        again.save_checkpoint(small_checkpoint(4, seed=2), tmp_path / "b.ckpt")
    again.save_checkpoint(small_checkpoint(6, seed=2), tmp_path / "c.ckpt")
    # Step 4 holds other bits already: the commit fails after save_checkpoint returned.
    again.save_checkpoint(small_checkpoint(4, seed=2), tmp_path / "b.ckpt")
    with pytest.raises(AlreadyCommitted):
        again.teardown()
    assert not (tmp_path / "b.ckpt").exists()  # no pointer to what never committed


def test_a_torch_save_file_loads_with_weights_only(io: CkptdCheckpointIO, tmp_path: Path) -> None:
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.arange(3.0)}, "epoch": 2}, path)
    got = io.load_checkpoint(path)
    assert got["epoch"] == 2 and torch.equal(got["state_dict"]["w"], torch.arange(3.0))
    torch.save({"obj": argparse.Namespace(a=1)}, path)
    with pytest.raises(UnsupportedValue, match="pickled objects.*Namespace") as err:
        io.load_checkpoint(path)
    assert "\n" not in err.value.message


def test_a_file_neither_pointer_nor_torch_save_is_refused_in_one_line(
        io: CkptdCheckpointIO, tmp_path: Path) -> None:
    """Such a file gave torch's errors (an UnpicklingError advising
    weights_only=False, EOFError, KeyError 101); a pointer cut short says so."""
    path = tmp_path / "last.ckpt"
    path.write_text('{"format": "ckptd.lightning_pointer", "job": "fa')
    with pytest.raises(InvalidRequest, match="damaged ckptd pointer") as err:
        io.load_checkpoint(path)
    assert str(path) in err.value.message and "\n" not in err.value.message
    torch.save({"w": torch.arange(1000.0)}, path)
    path.write_bytes(path.read_bytes()[:300])  # a torch.save file cut short
    with pytest.raises(InvalidRequest, match="not a readable torch.save file"):
        io.load_checkpoint(path)
    for content in (b"", b"hello\n", b'{"a": 1}', b"e" * 10):
        path.write_bytes(content)
        with pytest.raises(InvalidRequest,
                           match="neither a ckptd pointer nor a torch.save checkpoint") as err:
            io.load_checkpoint(path)
        assert str(path) in err.value.message and "\n" not in err.value.message


def test_a_job_is_asked_for_and_an_unreachable_server_said_at_construction(
        store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No job said "job name '' must match ..."; a server that cannot be reached was
    found at the first save, after an epoch of training (reach.py, as a
    Checkpointer's construction does: no rank or process group is needed for it)."""
    with pytest.raises(InvalidName, match="pass job=") as err:
        CkptdCheckpointIO(store)
    assert "\n" not in err.value.message
    monkeypatch.setenv("CKPTD_SERVER_WAIT", "0")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match="cannot reach the ckptd server") as err:
        CkptdCheckpointIO(url, job="lit")
    assert url in err.value.message


def test_fabric_saves_and_loads_in_place(store: str, shm: Path, tmp_path: Path) -> None:
    io = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 2)
    model, opt = fabric.setup(module, torch.optim.Adam(module.parameters()))
    fabric.backward(model(torch.ones(3, 5)).sum())
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": opt, "step": 3})
    io.teardown()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    rest = fabric.load(tmp_path / "fabric.ckpt", {"model": model, "optimizer": opt})
    io.teardown()
    assert rest == {"step": 3}
    assert_same(expected, dict(model.state_dict()))
    assert read_pointer(tmp_path / "fabric.ckpt")["step"] == 3  # type: ignore[index]


class _Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _fit(url: str, root: Path, shm: Path, epochs: int, resume: str | None) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=8)
    model = _Regressor()
    io = CkptdCheckpointIO(url, job=root.name, shm_dir=str(shm))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=[io],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=root, save_last=True, save_top_k=-1)])
    trainer.fit(model, loader, ckpt_path=resume)
    return {"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
            "step": trainer.global_step}


def test_a_trainer_resumes_from_last_over_a_server(server: ServerProcess, shm: Path,
                                                   tmp_path: Path) -> None:
    whole = _fit(server.url, tmp_path / "whole", shm, 3, None)
    _fit(server.url, tmp_path / "parts", shm, 2, None)
    resumed = _fit(server.url, tmp_path / "parts", shm, 3, "last")
    assert whole["step"] == resumed["step"] == 12
    assert_same(whole["model"], resumed["model"])
    assert_same(whole["optim"]["state"], resumed["optim"]["state"])
    assert read_pointer(tmp_path / "parts" / "last.ckpt")["step"] == 12  # type: ignore[index]


def test_a_save_on_another_rank_than_0_is_refused(io: CkptdCheckpointIO, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")  # (no process group here: the environment says)
    with pytest.raises(InvalidRequest, match="rank other than 0"):
        io.save_checkpoint(small_checkpoint(4), tmp_path / "x.ckpt")


def test_a_run_on_a_node_without_the_pointers_says_so_at_its_first_save(
        server: ServerProcess, shm: Path, tmp_path: Path) -> None:
    """ckpt_path="last" where the checkpoint directory holds no pointer (another
    node, a replacement one): Lightning finds no last checkpoint, warns and trains
    from scratch. The first save says what happened and what to do, before it
    stores anything (it failed later with AlreadyCommitted, after the training);
    ckpt_path="latest" resumes there."""
    whole = _fit(server.url, tmp_path / "whole" / "job", shm, 3, None)
    _fit(server.url, tmp_path / "a" / "job2", shm, 2, None)
    with pytest.raises(InvalidRequest) as raised:
        _fit(server.url, tmp_path / "b" / "job2", shm, 3, "last")
    message = str(raised.value)
    assert "committed steps up to 8" in message and "saving step 4" in message
    assert "ckpt_path='latest'" in message
    resumed = _fit(server.url, tmp_path / "b" / "job2", shm, 3, "latest")
    assert resumed["step"] == whole["step"] == 12
    assert_same(whole["model"], resumed["model"])
    assert_same(whole["optim"]["state"], resumed["optim"]["state"])
