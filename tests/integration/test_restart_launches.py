"""A job restarted between its ranks' manifests of one step never commits that step
with shards of both launches (docs/FORMAT.md, "Launches"), through a real
``ckptd serve``: the reviewer's reproduction of a torn FSDP checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer, Shard
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)

WORLD = 2


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4, 64), value)}


def shards(rank: int) -> dict[str, Shard]:
    """Rank ``rank`` holds rows [4 rank, 4 rank + 4) of an (8, 64) tensor: no replica
    for validation to compare across ranks."""
    return {"w": Shard(offsets=(rank * 4, 0), global_shape=(4 * WORLD, 64))}


def launch(url: str, job: str, shm: Path, attempt: int, via: str,
           monkeypatch: pytest.MonkeyPatch) -> list[Checkpointer]:
    """Every rank of one launch of the job; ``via`` names how it learns the launch."""
    extra: dict[str, Any] = {}
    if via == "argument":
        extra["incarnation"] = f"launch-{attempt}"
    else:  # what torchrun gives its workers on one node
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    return [Checkpointer(url, job, rank=r, world_size=WORLD, chunk_size=4096, shm_dir=shm,
                         timeout=30.0, serve_peers=False, **extra) for r in range(WORLD)]


@pytest.mark.parametrize("via", ["argument", "torchrun"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_restart_never_commits_a_step_with_shards_of_both_launches(
    server: ServerProcess, shm: Path, monkeypatch: pytest.MonkeyPatch, via: str,
    order: tuple[int, int],
) -> None:
    monkeypatch.delenv("CKPTD_INCARNATION", raising=False)
    job = "restart"
    first = launch(server.url, job, shm, 0, via, monkeypatch)
    for r, c in enumerate(first):
        assert c.save(5, state(5.0), shards=shards(r)).wait(30).state in ("pending",
                                                                          "committed")
    # Rank 0 puts its manifest of step 10; the group dies before rank 1 does.
    assert first[0].save(10, state(10.0), shards=shards(0)).wait(30).state == "pending"
    for c in first:
        c.close()

    second = launch(server.url, job, shm, 1, via, monkeypatch)
    try:
        for r, c in enumerate(second):
            back = state(0.0)
            c.restore(back, shards=shards(r))
            assert float(back["w"][0, 0]) == 5.0
        # Step 10 trained again, to other bytes (GPU training rarely repeats bitwise).
        states = {r: second[r].save(10, state(10.5), shards=shards(r)).wait(30).state
                  for r in order}
        assert states[order[0]] == "pending" and states[order[1]] == "committed"
        assert second[0].latest() == 10
        for r, c in enumerate(second):
            back = state(0.0)
            c.restore(back, 10, shards=shards(r))
            assert float(back["w"][0, 0]) == 10.5, f"rank {r} restored another launch's shard"
    finally:
        for c in second:
            c.close()
