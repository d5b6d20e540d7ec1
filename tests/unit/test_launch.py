"""Which launch the environment names (client/launch.py): only names every rank of
one launch sees alike, or none."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd.client.checkpointer as checkpointer_module
from ckptd.client import Checkpointer, CheckpointerConfig
from ckptd.client.dcp import Writer
from ckptd.client.launch import launch_incarnation
from ckptd.errors import InvalidRequest, UnsupportedValue
from ckptd.repository import Repository
from ckptd.store import LocalStore


def test_the_environment_names_the_launch() -> None:
    assert launch_incarnation({}) is None
    assert launch_incarnation({"CKPTD_INCARNATION": "mine",
                               "TORCHELASTIC_RUN_ID": "r"}) == "mine"  # explicit wins
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2",
                "GROUP_WORLD_SIZE": "1", "SLURM_JOB_ID": "77"}
    assert launch_incarnation(torchrun) == "torchelastic:r:2"
    assert launch_incarnation({**torchrun, "TORCHELASTIC_RESTART_COUNT": "3"}) != (
        launch_incarnation(torchrun))
    # Several agents count restarts each on their own: no name, rather than two.
    assert launch_incarnation({**torchrun, "GROUP_WORLD_SIZE": "2"}) is None
    assert launch_incarnation({"SLURM_JOB_ID": "77"}) == "slurm:77:0"
    assert launch_incarnation({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}) == (
        "slurm:77:1")
    with pytest.raises(InvalidRequest):
        launch_incarnation({"CKPTD_INCARNATION": "x" * 257})


def test_the_config_takes_the_launch_from_the_argument_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_INCARNATION", "from-env")
    assert CheckpointerConfig.of("file:///tmp/x", "j").incarnation == "from-env"
    assert CheckpointerConfig.of("file:///tmp/x", "j", incarnation="arg").incarnation == "arg"
    with pytest.raises(InvalidRequest):
        CheckpointerConfig.of("file:///tmp/x", "j", incarnation="")


def test_saves_name_the_launch_and_users_cannot(tmp_path: Path, shm: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    for name in ("CKPTD_INCARNATION", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(checkpointer_module, "_said_no_launch", False)
    url = f"file://{tmp_path / 'store'}"
    with (caplog.at_level(logging.INFO, logger="ckptd.client.checkpointer"),
          Checkpointer(url, "j", rank=1, world_size=2, shm_dir=shm) as unnamed):
        Checkpointer(url, "j", rank=0, world_size=2, shm_dir=shm).close()
        assert unnamed.config.incarnation is None
    said = [r for r in caplog.records if "no launch id" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO  # once per process
    with Checkpointer(url, "j", shm_dir=shm, incarnation="launch-a") as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait(30)
        with pytest.raises(UnsupportedValue):
            ckpt.save(2, {"w": torch.ones(4)}, meta={"incarnation": "other"})
        # The manifest names the launch, and so does the commit record (the commit
        # call says which launch commits).
        manifest = ckpt._call(ckpt.transport.read_manifest("j", 1, 0), 30)
        record = ckpt._call(ckpt.transport.read_commit("j", 1), 30)
        assert manifest.meta["incarnation"] == record.meta["incarnation"] == "launch-a"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_names_the_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_INCARNATION", "dcp-launch")
    store = tmp_path / "store"
    dcp.save({"w": torch.ones(8)}, storage_writer=Writer(f"file://{store}", "d", 3),
             no_dist=True)

    async def read() -> tuple[object, object]:
        repo = Repository(LocalStore(store))
        try:
            # The commit names it too: a smaller relaunch commits without the dead
            # launch's ranks past its world size.
            return ((await repo.read_manifest("d", 3, 0)).meta.get("incarnation"),
                    (await repo.read_commit("d", 3)).meta.get("incarnation"))
        finally:
            await repo.close()

    assert asyncio.run(read()) == ("dcp-launch", "dcp-launch")


def test_ranks_agree_on_a_live_launch_id_not_a_dead_launchs() -> None:
    """torchrun's shared agent store outlives launches: a dead launch's id is still
    there when the next launch's ranks meet. They take only an id whose beat moves
    (its rank 0 is alive), and all the same one."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from ckptd.client.distributed import agree_on_launch

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30),  # type: ignore[attr-defined]
                          wait_for_workers=False)
    store.set("ckptd/launch", "deadlaunch 41")  # what the dead launch's rank 0 left
    got: dict[int, str] = {}

    def rank(r: int) -> None:
        got[r] = agree_on_launch(store, r, 3, 30.0)

    others = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in others:
        t.start()
    time.sleep(0.4)  # the others look at the dead id a while: it never moves
    assert not got
    rank(0)
    for t in others:
        t.join(30)
    assert got[0] == got[1] == got[2] != "deadlaunch"
    assert len(got[0]) == 32
