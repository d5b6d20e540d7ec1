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
