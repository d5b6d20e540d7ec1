"""Several shards of one tensor on one rank (``ShardedTensor``) through ckptd's DCP
Writer and Reader, as torch's own FileSystemWriter stores them: 2 torchrun ranks,
gloo on the CPU, a real server. The scenarios of PyTorch's
TestDistributedReshardOnLoad (test_load_with_different_shard_plan,
test_switch_between_sharded_tensor_to_tensor), with 1 and 2 threads, written for
ckptd; and what one rank manifest cannot hold, refused before any byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.e2e]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("threads", [1, 2])
def test_sharded_tensors_with_several_local_shards_save_and_reshard(
    threads: int, server: Any, torchrun: Any, tmp_path: Path
) -> None:
    results = torchrun("dcp_sharded_tensor.py", 2, server.url, f"st{threads}", str(threads),
                       out=tmp_path / "out", timeout=360)
    for rank, r in enumerate(results):
        failed = sorted(name for name, ok in r.items() if not ok)
        assert not failed, (rank, failed)
    names = set(results[0])
    assert sum(n.startswith("plan ") for n in names) == 12
    assert sum(n.startswith("switch ") for n in names) == 16
    assert "checkpointer restore" in names
    # Rank 0 holds two rows-shards of the "0110" plan: two entries of one name.
    store = Path(server.store)
    step = 2  # the "0110" plan's save (plans are saved in order: halves, 0110, ...)
    doc = json.loads((store / f"jobs/st{threads}/steps/{step}/ranks/0.json").read_text())
    boxes = [e["offsets"] for e in doc["entries"] if e["name"] == "sharded_tensor"]
    assert sorted(boxes) == [[0, 0], [9, 0]]  # rows 0..2 and 9 of 10 (chunks of 3)
    assert [k for k, _ in doc["tree"]["dict"]] == ["sharded_tensor"]


def _item(offset: int, rows: int = 2, fqn: str = "w") -> Any:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    box = ChunkStorageMetadata(torch.Size([offset, 0]), torch.Size([rows, 4]))
    return WriteItem(MetadataIndex(fqn, torch.Size([offset, 0])), WriteItemType.SHARD,
                     tensor_data=TensorWriteData(box, TensorProperties(dtype=torch.float32),
                                                 torch.Size([8, 4])))


def test_what_one_rank_cannot_hold_is_refused_before_any_byte() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from ckptd.client.dcp import Writer
    from ckptd.errors import UnsupportedValue
    from ckptd.format import MAX_LOCAL_SHARDS

    writer = Writer("file:///tmp/unused", "j", 1)
    plan = SavePlan([_item(0), _item(4)])  # two shards of one tensor: fine
    assert writer.prepare_local_plan(plan) is plan
    with pytest.raises(UnsupportedValue, match="overlap"):
        writer.prepare_local_plan(SavePlan([_item(0, 3), _item(2)]))
    value = WriteItem(MetadataIndex("w"), WriteItemType.BYTE_IO)
    with pytest.raises(UnsupportedValue, match="both a value and a tensor"):
        writer.prepare_local_plan(SavePlan([_item(0), value]))
    many = [_item(0, 0)] + [_item(i % 8, 0) for i in range(MAX_LOCAL_SHARDS)]
    with pytest.raises(UnsupportedValue, match="at most"):
        writer.prepare_local_plan(SavePlan(many))
