"""A restore that runs out of its timeout says which restore and which timeout,
not the sliver of it that was left to its last part ("gave up after 0.00086 s")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import Timeout


def test_a_restore_past_its_timeout_names_the_job_and_the_timeout(
    tmp_path: Path, shm: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "slowjob", shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, {"w": torch.randn(1 << 16)}).wait(60)
    with Checkpointer(url, "slowjob", shm_dir=shm, serve_peers=False) as ckpt, \
            pytest.raises(Timeout) as err:
        ckpt.restore({"w": torch.zeros(1 << 16)}, tiers=("store",), timeout=1e-9)
    message = str(err.value)
    assert "slowjob" in message and "1e-09 s timeout" in message, message
    assert err.value.detail["timeout_s"] == 1e-9
