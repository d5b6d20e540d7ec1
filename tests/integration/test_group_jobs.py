"""A rank whose job name is not its launch's others' (a replacement node started
with another ``JOB``) is said: it restored nothing, trained out of step with the
others, and its steps and theirs never committed, without a word (found by a
multinode probe). This process is rank 1 of a world of 2 over a real ``TCPStore``
on 127.0.0.1 (torch's ``fake`` backend: no collective reaches anyone; the check
uses only the group's store); rank 0's first save is made by hand."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckptd.client import Checkpointer
from ckptd.client.launch import launch_incarnation
from ckptd.client.save.group_jobs import GroupJobs


@pytest.fixture
def rank_one() -> Iterator[str]:
    """This process as rank 1 of 2; yields the launch id its group agreed on."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=10))
    dist.init_process_group("fake", store=store, rank=1, world_size=2)
    try:
        launch = launch_incarnation()
        assert launch is not None
        yield launch
    finally:
        dist.destroy_process_group()


def _saves(url: str, job: str, shm: Path) -> None:
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with Checkpointer(url, job, rank=1, world_size=2, shm_dir=str(shm),
                      serve_peers=False, timeout=10) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, state)


def test_a_rank_saving_under_another_job_than_its_launch_is_said_once(
        rank_one: str, tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"file://{tmp_path / 'store'}"
    GroupJobs("jn", 0, 2).saving(rank_one)  # (rank 0's first save, under "jn")
    with caplog.at_level(logging.WARNING, logger="ckptd.client.save.group_jobs"):
        _saves(url, "jn-v2", shm / "a")
    warned = [r.getMessage() for r in caplog.records if "several jobs" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "jn (1), jn-v2 (1), of a world of 2" in warned[0], warned
    assert "JOB" in warned[0] and len(warned[0].splitlines()) == 1
    # A job every rank of the launch saves under (rank 1's "jn" now) is no mistake,
    # whatever other job the launch's ranks save under too (a model's and its EMA's).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptd.client.save.group_jobs"):
        _saves(url, "jn", shm / "b")
    assert not [r for r in caplog.records if "several jobs" in r.getMessage()], caplog.text
