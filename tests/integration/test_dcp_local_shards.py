"""DCP loads of steps whose ranks hold several shards of one tensor (format 1.3):
an empty shard may start where a shard with bytes starts (torch's own checks
allow it: an empty box overlaps nothing), and the Reader, which indexes a
tensor's stored boxes by their offsets as DCP's own metadata does, must list the
one with bytes (found by review: the first one won, and a load with the empty
one listed left the target as it was, without an error)."""

from __future__ import annotations

import asyncio
import dataclasses
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


def test_empty_shards_repeated_on_a_rank_are_saved_as_torch_saves_them(tmp_path: Path) -> None:
    """An empty shard repeated on one rank (an EnumerableShardingSpec may place two
    empty shards at one offset; torch's FileSystemWriter saves them) holds nothing
    to store twice: the save succeeds and the tensor loads (it was refused as an
    invalid manifest, "holds box ... twice")."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    from ckptd.client.dcp import Writer

    class EmptyShardsTwice(DefaultSavePlanner):
        """The whole [4, 3] tensor as one shard, then an empty shard at row 4, twice
        (the items a ShardedTensor with those three local shards gives)."""

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            (whole,) = plan.items
            assert whole.tensor_data is not None

            def shard(offsets: list[int], sizes: list[int]) -> WriteItem:
                assert whole.tensor_data is not None
                box = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                return WriteItem(MetadataIndex("w", torch.Size(offsets)), WriteItemType.SHARD,
                                 tensor_data=TensorWriteData(box, whole.tensor_data.properties,
                                                             whole.tensor_data.size))

            items = [shard([0, 0], [4, 3]), shard([4, 0], [0, 3]), shard([4, 0], [0, 3])]
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
            assert write_item.tensor_data is not None
            box = write_item.tensor_data.chunk
            return self.state_dict["w"][tuple(slice(o, o + n) for o, n in
                                              zip(box.offsets, box.sizes, strict=True))]

    url = f"file://{tmp_path / 'store'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": FULL.clone()}, storage_writer=Writer(url, "e", 1),
                 planner=EmptyShardsTwice())
        target = {"w": torch.zeros(4, 3)}
        dcp.load(target, storage_reader=Reader(url, "e"))
    assert torch.equal(target["w"], FULL)
