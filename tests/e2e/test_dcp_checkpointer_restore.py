"""``Checkpointer.restore`` of a step that ``dcp.save`` wrote on 2 gloo ranks: DCP
saves each replicated item (a plain tensor, bytes, a value) once, on one rank it
picks, yet every rank's restore gets it, at the same world size and at another."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer

pytestmark = [pytest.mark.e2e]

W = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def tensor(node: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(node["values"], dtype=torch.float32).reshape(node["shape"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_restores_the_items_dcp_saved_once(
    server: Any, torchrun: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(Found by a probe.) Rank 0 restored ``{'w'}`` only and rank 1 ``{'w', 'b',
    'epoch', 'blob'}``; a template of every key was refused on rank 0 ("lacks 2
    entries"); a restore at world size 1 lost ``b`` and ``epoch`` and warned that
    rank 1's rank-local entries were restored by no rank."""
    results = torchrun("dcp_restored.py", 2, server.url, "dcpr", out=tmp_path / "out")
    # (a bytes item is the blob DCP's planner made of it, which a Checkpointer gives
    # as stored: the same on every rank)
    blob = results[1]["empty"]["blob"]
    replicated = {"b": {"shape": [3], "values": [0.0, 1.0, 2.0]}, "epoch": {"value": 7},
                  "blob": blob}
    for rank, r in enumerate(results):
        own = {"shape": [3, 4], "values": W[3 * rank:3 * rank + 3].reshape(-1).tolist()}
        assert r["empty"] == {"w": own, **replicated}, rank
        assert r["template"] == {"w": own, **replicated}, rank
    restored: dict[str, Any] = {}
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(), Checkpointer(
            server.url, "dcpr", rank=0, world_size=1, serve_peers=False, timeout=60) as ckpt:
        warnings.simplefilter("ignore")
        ckpt.restore(restored, 100)
    assert set(restored) == {"w", "b", "epoch", "blob"}
    assert not [r.getMessage() for r in caplog.records if "rank-local" in r.getMessage()]
    assert torch.equal(restored["w"], W)
    assert torch.equal(restored["b"], torch.arange(3.0))
    assert restored["epoch"] == 7 and restored["blob"].hex() == blob["bytes"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_pipeline_stage_restores_its_own_and_the_shared_items_only(
        server: Any, torchrun: Any, tmp_path: Path) -> None:
    """Each rank is a pipeline stage: its own weight, and items both stages hold
    (DCP saves those once). A restore of every item any rank saved gave each stage's
    rank the other stage's weights too (the whole model on every rank)."""
    results = torchrun("dcp_restored.py", 2, server.url, "dcps", "stages",
                       out=tmp_path / "out")
    shared = {"shared": {"shape": [2], "values": [0.0, 1.0]}, "epoch": {"value": 3}}
    for rank, r in enumerate(results):
        own = {f"stage{rank}.w": {"shape": [4], "values": [float(rank)] * 4}}
        assert r["stages"] == {**own, **shared}, rank
    # At another world size the one rank takes every stage's items: the whole step.
    restored: dict[str, Any] = {}
    with warnings.catch_warnings(), Checkpointer(
            server.url, "dcps", rank=0, world_size=1, serve_peers=False, timeout=60) as ckpt:
        warnings.simplefilter("ignore")
        ckpt.restore(restored, 200)
    assert set(restored) == {"stage0.w", "stage1.w", "shared", "epoch"}
