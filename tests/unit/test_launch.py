"""Which launch the environment names (client/launch.py): only names every rank of
one launch sees alike, or none."""

from __future__ import annotations

import asyncio
import logging
import os
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
from tests.conftest import free_port


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



def test_one_agent_names_its_launches_apart_from_another_agents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same torchrun command run again (a fixed --rdzv-id, a pod restart) has
    the same run id and counts from 0 again: the id its agent's store holds, put by
    the first worker to ask, tells the two agents' launches apart; every worker of
    one agent reads the same one."""
    from datetime import timedelta

    import torch.distributed as dist

    import ckptd.client.launch as launch

    def agent() -> dict[str, str]:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30),  # type: ignore[attr-defined]
                              wait_for_workers=False)
        stores.append(store)
        return {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0",
                "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}

    stores: list[object] = []
    first, second = agent(), agent()
    names = []
    for env in (first, first, second):
        monkeypatch.setattr(launch, "_agents", {})  # each ask as a worker process of its own
        names.append(launch_incarnation(env))
    assert names[0] == names[1] != names[2]
    assert all(n is not None and n.startswith("torchelastic:job:0:") for n in names)

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
        # Said at the first save: a process group made after the checkpointer names
        # the launch then.
        assert unnamed.save(1, {"w": torch.ones(4)}).wait(30).state == "pending"
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
    keys = store.num_keys()
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
    # The agent's store outlives every restart of the run: a launch leaves nothing
    # there but its id, which the next launch overwrites (it left an "I have it" key
    # per rank, every launch: ranks times restarts).
    assert store.num_keys() == keys


GROUP_TIMEOUT = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
from ckptd.client.distributed import init_process_group
init_process_group("gloo", **({"timeout": timedelta(seconds=int(sys.argv[1]))}
                               if len(sys.argv) > 1 else {}))
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print(int(backend.options._timeout.total_seconds()))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("share", ["True", "False"])
def test_the_helpers_group_has_the_timeout_torch_gives_or_the_one_given(
        share: str, tmp_path: Path) -> None:
    """With torchrun's shared agent store and without, the helper's group times its
    collectives out as plain ``dist.init_process_group`` does: torch's default for
    the backend (30 min for gloo) unless given one. (It was 5 min with the store
    shared: a rank 0 busy for longer, others waiting in a barrier, ended the job.)"""
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30),  # type: ignore[attr-defined]
                          wait_for_workers=False)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": share,
           "MASTER_PORT": str(store.port if share == "True" else free_port())}
    seconds = []
    for args in ([], ["90"]):
        done = subprocess.run([sys.executable, "-c", GROUP_TIMEOUT, *args], env=env,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        seconds.append(int(done.stdout.split()[-1]))
    assert seconds == [1800, 90]


BEFORE_AND_AFTER = """
import sys, torch, torch.distributed as dist
from ckptd.client import Checkpointer
url, shm, port = sys.argv[1], sys.argv[2], sys.argv[3]
before = Checkpointer(url, "mixed", 0, 2, shm_dir=shm)  # made before the group
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
after = Checkpointer(url, "mixed", 1, 2, shm_dir=shm)
states = [c.save(1, {"w": torch.ones(4)}).wait(30).state for c in (before, after)]
print(states[-1], before.config.incarnation == after.config.incarnation, before.latest())
before.close(); after.close()
dist.destroy_process_group()
"""


def test_a_checkpointer_made_before_the_group_saves_in_the_groups_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank made its Checkpointer before init_process_group, another after: the
    first named no launch (or only CKPTD_INCARNATION), the second the group's, and
    no step ever committed, nothing said. The first now takes the group's launch at
    its first save once the group is there."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "SLURM", "CKPTD_INCARNATION", "RANK",
                                "WORLD_SIZE", "LOCAL_RANK", "MASTER"))}
    (tmp_path / "shm").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", BEFORE_AND_AFTER, f"file://{tmp_path / 'store'}",
         str(tmp_path / "shm"), str(free_port())],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["committed", "True", "1"], done.stdout + done.stderr
