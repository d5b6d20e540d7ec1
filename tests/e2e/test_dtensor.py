"""Sharded state as DTensors: the global shape and offsets come from the
placements (the user describes nothing), the step commits (the boxes tile every
tensor), and fresh DTensors restore bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]


def test_dtensors_save_commit_and_restore_bitwise(torchrun: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    results = torchrun("dtensor.py", 4, f"file://{store}", "dt", out=tmp_path / "out")
    for rank, r in enumerate(results):
        assert r["latest"] == 1, rank
        assert r["step"] == 5 and r["plain"], rank
        for name, check in r["checks"].items():
            assert check == {"same_object": True, "local": True, "full": True}, (rank, name)

    manifests = [json.loads((store / f"jobs/dt/steps/1/ranks/{r}.json").read_text())
                 for r in range(4)]
    boxes = {r: {e["name"]: (e["placement"], e["global_shape"], e["offsets"], e["shape"])
                 for e in m["entries"]} for r, m in enumerate(manifests)}
    # Offsets and global shapes come from the placements, uneven splits included.
    assert [boxes[r]["model.uneven"] for r in range(4)] == [
        ("sharded", [10, 3], [0, 0], [3, 3]), ("sharded", [10, 3], [3, 0], [3, 3]),
        ("sharded", [10, 3], [6, 0], [3, 3]), ("sharded", [10, 3], [9, 0], [1, 3])]
    assert [boxes[r]["model.tiny"][2:] for r in range(4)] == [
        ([0, 0], [1, 5]), ([1, 0], [1, 5]), ([2, 0], [0, 5]), ([2, 0], [0, 5])]
    assert [boxes[r]["model.cols"][2:] for r in range(4)] == [
        ([0, 0], [4, 3]), ([0, 3], [4, 3]), ([0, 6], [4, 3]), ([0, 9], [4, 0])]
    assert all(boxes[r]["model.rep"] == ("replicated", [5], [0], [5]) for r in range(4))
    # HSDP: ranks 0 and 2 (and 1 and 3) hold the same box: replicas of one shard.
    hsdp = [boxes[r]["model.hsdp"] for r in range(4)]
    assert hsdp[0] == hsdp[2] == ("sharded", [7, 4], [0, 0], [4, 4])
    assert hsdp[1] == hsdp[3] == ("sharded", [7, 4], [4, 0], [3, 4])
    assert manifests[0]["entries"] and all(
        e["chunks"] == next(x for x in manifests[2]["entries"] if x["name"] == e["name"])["chunks"]
        for e in manifests[0]["entries"] if e["name"] == "model.hsdp")
    commit = json.loads((store / "jobs/dt/steps/1/commit.json").read_text())
    assert commit["report"]["warnings"] == []
    assert commit["report"]["tensors"] == 8  # seven DTensors and "plain"
