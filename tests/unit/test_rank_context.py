"""A rank outside its world size is named with its job and the world size."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.errors import InvalidName
from ckptd.format import check_rank


def test_check_rank_names_the_job_and_the_world_size() -> None:
    with pytest.raises(InvalidName) as raised:
        check_rank(3, 1, job="llm-7b")
    message = str(raised.value)
    assert "rank 3" in message and "'llm-7b'" in message
    assert "world size is 1" in message and "0 to 0" in message
    assert raised.value.detail == {"rank": 3, "world_size": 1, "job": "llm-7b"}


def test_a_checkpointer_with_a_rank_past_its_world_says_which_job(tmp_path: Path) -> None:
    from ckptd.client import Checkpointer

    with pytest.raises(InvalidName, match=r"rank 3 of job 'llm-7b'.*world size is 2"):
        Checkpointer(f"file://{tmp_path / 'store'}", job="llm-7b", rank=3, world_size=2,
                     shm_dir=tmp_path / "shm")


def test_a_checkpointer_takes_its_rank_from_the_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets RANK, WORLD_SIZE and LOCAL_RANK: ``Checkpointer(job=...)`` is rank 2
    of 4 under it, and explicit arguments still win."""
    from ckptd.client import Checkpointer

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, job="env", shm_dir=tmp_path / "shm") as ckpt:
        assert (ckpt.rank, ckpt.world_size, ckpt.config.local_rank) == (2, 4, 0)
    with Checkpointer(url, job="env", rank=1, world_size=2, local_rank=1,
                      shm_dir=tmp_path / "shm") as ckpt:
        assert (ckpt.rank, ckpt.world_size, ckpt.config.local_rank) == (1, 2, 1)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    with Checkpointer(url, job="env", shm_dir=tmp_path / "shm") as ckpt:
        assert (ckpt.rank, ckpt.world_size, ckpt.config.local_rank) == (0, 1, None)


def test_a_launcher_variable_that_is_no_number_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.client import Checkpointer
    from ckptd.errors import InvalidRequest

    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(InvalidRequest, match=r"WORLD_SIZE='four'.*world_size="):
        Checkpointer(f"file://{tmp_path / 'store'}", job="env", shm_dir=tmp_path / "shm")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")  # past the world: named as an explicit rank is
    with pytest.raises(InvalidName, match=r"rank 2 of job 'env'.*world size is 2"):
        Checkpointer(f"file://{tmp_path / 'store'}", job="env", shm_dir=tmp_path / "shm")


def test_the_health_probe_watches_the_ranks_own_gpu() -> None:
    """LOCAL_RANK names the GPU whose health is this rank's (every GPU of the host
    before: one hot GPU degraded all its ranks), as NVML names it, no CUDA touched."""
    from ckptd.client.failover import rank_gpus

    assert rank_gpus(None, {}) is None
    assert rank_gpus(3, {}) == [3]
    assert rank_gpus(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == [5]
    assert rank_gpus(0, {"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-11c0"}) == ["GPU-8f2a"]
    assert rank_gpus(2, {"CUDA_VISIBLE_DEVICES": "4,5"}) is None  # past them: watch all
