"""``atomic=False`` restores from an in-place tier (the staging pool, the store's
files) in one pass: each chunk is copied into the target and hashed there. A chunk
the pool holds wrong is then overwritten from the next tier, so the target still
ends bitwise the checkpoint; ``atomic=True`` verifies first and gets the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import RestoreError

CHUNK = 64 << 10


@pytest.fixture
def pool_root(monkeypatch: pytest.MonkeyPatch, shm: Path) -> Path:
    """This test's staging root (the shared ``shm`` fixture), for every Checkpointer."""
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    return shm


@pytest.mark.parametrize("atomic", [False, True])
def test_a_chunk_the_pool_holds_wrong_comes_from_the_store(
    tmp_path: Path, pool_root: Path, atomic: bool
) -> None:
    g = torch.Generator().manual_seed(9)
    state = {f"t{i}": torch.randn(3 * CHUNK // 4 + 101 * i, generator=g) for i in range(6)}
    url = f"file://{tmp_path / 'store'}"
    writer = Checkpointer(url, "onepass", chunk_size=CHUNK)
    writer.save(1, state).wait(timeout=60)
    pool_dir = writer.staging.directory
    seg = max((p for p in pool_dir.iterdir() if p.name.startswith("seg-")),
              key=lambda p: p.stat().st_size)
    with open(seg, "r+b") as f:  # the generation stays even: the index still claims it
        f.seek(0)
        f.write(os.urandom(1024))
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    before = dict(targets)
    with Checkpointer(url, "onepass") as reader:
        result = reader.restore(targets, atomic=atomic)
    writer.close()
    for k, v in state.items():
        assert targets[k] is before[k]
        assert torch.equal(targets[k].view(torch.int32), v.view(torch.int32)), k
    assert result.bytes_from["local"] > 0 and result.bytes_from["store"] > 0
    assert result.bytes_from["local"] + result.bytes_from["store"] == result.bytes_fetched
    assert [p.tier for p in result.problems] == ["local"]


def test_a_one_pass_restore_that_fails_says_the_target_was_written(
    tmp_path: Path, pool_root: Path
) -> None:
    """Every staged byte corrupt and only the pool asked: the copies into the
    target happened before the hashes failed, so the error says it is partial."""
    state = {"t": torch.randn(CHUNK // 4 * 3, generator=torch.Generator().manual_seed(2))}
    url = f"file://{tmp_path / 'store'}"
    writer = Checkpointer(url, "onepass", chunk_size=CHUNK, serve_peers=False)
    writer.save(1, state).wait(timeout=60)
    seg = max((p for p in writer.staging.directory.iterdir() if p.name.startswith("seg-")),
              key=lambda p: p.stat().st_size)
    with open(seg, "r+b") as f:  # the generation stays even: the index still claims it
        size = f.seek(0, 2)
        f.seek(0)
        f.write(os.urandom(size))
    target = {"t": torch.zeros_like(state["t"])}
    with Checkpointer(url, "onepass", serve_peers=False) as reader, pytest.raises(
        RestoreError
    ) as info:
        reader.restore(target, tiers=("local",), atomic=False)
    writer.close()
    assert target["t"].view(torch.int32).any()  # what the pool gave did land
    assert info.value.detail["partial"] is True and "partly restored" in str(info.value)
    assert info.value.detail["step"] == 1
