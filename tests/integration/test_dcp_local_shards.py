"""DCP loads of steps whose ranks hold several shards of one tensor (format 1.3):
an empty shard may start where a shard with bytes starts (torch's own checks
allow it: an empty box overlaps nothing), and the Reader, which indexes a
tensor's stored boxes by their offsets as DCP's own metadata does, must list the
one with bytes (found by review: the first one won, and a load with the empty
one listed left the target as it was, without an error)."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.client.dcp import Reader
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import flat_tree, rank_manifest, tensor_entry

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # no process group

FULL = torch.arange(1, 13, dtype=torch.float32).view(4, 3)


def commit_step(root: Path, empty_first: bool) -> None:
    """Step 1 of job "j", one rank holding "w" [4, 3] whole and an empty box [0, 3]
    at the same offsets, in the order given."""
    full, chunks = tensor_entry("w", "float32", [4, 3], FULL.numpy().tobytes(),
                                placement="sharded")
    empty, _ = tensor_entry("w", "float32", [0, 3], b"", placement="sharded",
                            global_shape=[4, 3], offsets=[0, 0])
    entries = [empty, full] if empty_first else [full, empty]
    manifest = rank_manifest("j", 1, 0, 1, entries, tree=flat_tree(["w"]))

    async def write() -> None:
        repo = Repository(LocalStore(root, fsync=False))
        try:
            for cid, data in chunks.items():
                await repo.put_chunk(cid, data)
            await repo.put_manifest(manifest)
            assert (await repo.commit("j", 1)).state == "committed"
        finally:
            await repo.close()

    asyncio.run(write())


@pytest.mark.parametrize("empty_first", [True, False])
def test_an_empty_shard_at_the_offsets_of_a_full_one_loads_the_full_one(
        tmp_path: Path, empty_first: bool) -> None:
    commit_step(tmp_path / "store", empty_first)
    reader = Reader(f"file://{tmp_path / 'store'}", "j")
    chunks = reader.read_metadata().state_dict_metadata["w"].chunks  # type: ignore[union-attr]
    assert [list(c.sizes) for c in chunks] == [[4, 3]]
    target = {"w": torch.zeros(4, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=Reader(f"file://{tmp_path / 'store'}", "j"))
    assert torch.equal(target["w"], FULL)
