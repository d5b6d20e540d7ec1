"""``ckpt.save(..., tag=...)``: the committed step is tagged, so retention keeps it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.lifecycle.retention import RetentionPolicy, forget
from ckptd.lifecycle.tags import read_tags
from ckptd.repository import Repository
from ckptd.store import LocalStore

pytestmark = pytest.mark.timeout(120)


def test_a_tagged_save_survives_retention(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "store"
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with Checkpointer(f"file://{root}", "tagged") as ckpt:
        for step in range(1, 5):
            state["w"] += 1
            tag = "eval-best" if step == 2 else None
            assert ckpt.save(step, state, tag=tag).wait().state == "committed"

    async def check() -> list[int]:
        repo = Repository(LocalStore(root))
        assert await read_tags(repo.store, "tagged") == {"eval-best": 2}
        plan = await forget(repo, "tagged", RetentionPolicy(keep_last=1))
        return plan.forgotten

    assert asyncio.run(check()) == [1, 3]
