"""The zarr view of a committed step: bitwise, lazy, verified, over file:// and HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr
from zarr.core.sync import sync

from ckptd.client.transport import LocalTransport
from ckptd.errors import ChunkHashMismatch, IntegrityError
from ckptd.zarr import CheckpointStore
from tests.conftest import ServerProcess
from tests.zarr.conftest import JOB, as_numpy, global_state, save_step


class CountingTransport(LocalTransport):
    """A real in-process transport that counts the chunks asked of it."""

    def __init__(self, path: str) -> None:
        super().__init__(LocalTransport.open(path).repository)
        self.asked: list[str] = []

    async def get_chunk(self, cid: str) -> bytes:
        self.asked.append(cid)
        return await super().get_chunk(cid)


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        path = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[path] = v
        elif isinstance(v, dict):
            out.update(_tensors(v, f"{path}/"))
    return out


def _check_bitwise(root: zarr.Group) -> None:
    expected = _tensors(global_state())
    assert set(expected) == {
        "model/layers.0.attn.w", "model/embed", "model/ids", "model/mask",
        "optim/state/0/step", "optim/state/0/exp_avg", "count",
    }
    for path, tensor in expected.items():
        arr = root[path]
        assert isinstance(arr, zarr.Array)
        assert arr.shape == tuple(tensor.shape), path
        got = arr[...]
        want = as_numpy(tensor)
        assert got.dtype == want.dtype, path
        assert got.tobytes() == want.tobytes(), path
    w = root["model/layers.0.attn.w"]
    assert w.attrs["ckptd"] == {"name": "model.layers.0.attn.w", "dtype": "bfloat16",
                                "placement": "sharded"}
    bf = w[...].view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(bf, global_state()["model"]["layers.0.attn.w"].float().numpy())
    assert root.attrs["epoch"] == 3
    assert root["optim/param_groups/0"].attrs["eps"] == "Infinity"
    assert root["optim/param_groups/0"].attrs["lr"] == 0.001
    assert root.attrs["ckptd"]["step"] == 1


def test_view_over_a_file_store_reads_back_bitwise(file_step: str) -> None:
    store = CheckpointStore(file_step, JOB)
    _check_bitwise(zarr.open_group(store=store, mode="r"))
    assert store.step == 1
    with pytest.raises(Exception):  # noqa: B017 - read-only: zarr refuses before the store
        zarr.open_group(store=store, mode="r")["model/ids"][0:2] = 5


@pytest.mark.slow
def test_view_over_a_server_reads_back_bitwise(server: ServerProcess) -> None:
    save_step(server.url)
    store = CheckpointStore(server.url, JOB, step=1)
    _check_bitwise(zarr.open_group(store=store, mode="r"))
    store.close()


def test_a_slice_fetches_only_the_chunks_it_needs(file_step: str) -> None:
    transport = CountingTransport(file_step.removeprefix("file://"))
    store = CheckpointStore(file_step, JOB, transport=transport)
    root = zarr.open_group(store=store, mode="r")
    embed = root["model/embed"]
    assert embed.chunks == (4, 256)  # 1 KiB rows, 4 KiB chunks: one ckptd chunk each
    assert transport.asked == []  # opening reads documents only
    rows = embed[8:24, :]
    assert np.array_equal(rows, global_state()["model"]["embed"][8:24].numpy())
    h = sync(store.hierarchy())
    box = h.arrays["model/embed"].grid.boxes[0]
    assert transport.asked == list(box.chunks[2:6]) or sorted(transport.asked) == sorted(
        box.chunks[2:6])
    # A general grid (bf16 rows of 192 bytes do not divide 4096): still only what
    # the rows need, from the one shard that holds them.
    transport.asked.clear()
    w = root["model/layers.0.attn.w"]
    part = w[40:42, :]
    assert part.tobytes() == as_numpy(global_state()["model"]["layers.0.attn.w"][40:42]).tobytes()
    shard1 = h.arrays["model/layers.0.attn.w"].grid.boxes[1].chunks
    assert transport.asked and set(transport.asked) <= set(shard1)
    assert len(transport.asked) <= 2
    assert store.fetched == 4 + len(transport.asked)


def _chunk_file(store_dir: Path, cid: str) -> Path:
    return store_dir / "chunks" / cid[:2] / cid


def test_a_flipped_bit_raises_the_integrity_error_and_other_slices_still_read(
    file_step: str,
) -> None:
    store_dir = Path(file_step.removeprefix("file://"))
    store = CheckpointStore(file_step, JOB)
    root = zarr.open_group(store=store, mode="r")
    box = sync(store.hierarchy()).arrays["model/embed"].grid.boxes[0]
    bad = _chunk_file(store_dir, box.chunks[10])  # rows 40..43
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0x01
    bad.chmod(0o644)
    bad.write_bytes(bytes(raw))
    with pytest.raises(ChunkHashMismatch) as caught:
        root["model/embed"][38:42, :]
    assert isinstance(caught.value, IntegrityError)
    assert caught.value.detail["id"] == box.chunks[10]
    rows = root["model/embed"][0:40, :]
    assert np.array_equal(rows, global_state()["model"]["embed"][0:40].numpy())


@pytest.mark.slow
def test_a_flipped_bit_under_a_server_is_caught_by_the_reader(server: ServerProcess) -> None:
    save_step(server.url)
    store = CheckpointStore(server.url, JOB)
    root = zarr.open_group(store=store, mode="r")
    box = sync(store.hierarchy()).arrays["model/ids"].grid.boxes[0]
    bad = _chunk_file(server.store, box.chunks[1])  # int64 512 per chunk: 512..1023
    raw = bytearray(bad.read_bytes())
    raw[0] ^= 0x80
    bad.chmod(0o644)
    bad.write_bytes(bytes(raw))
    with pytest.raises(ChunkHashMismatch):
        root["model/ids"][600:610]
    assert np.array_equal(root["model/ids"][0:512], np.arange(512))
    store.close()


def test_the_cache_tier_serves_good_chunks_and_its_bad_ones_come_from_the_store(
    file_step: str, tmp_path: Path
) -> None:
    store_dir = Path(file_step.removeprefix("file://"))
    probe = CheckpointStore(file_step, JOB)
    box = sync(probe.hierarchy()).arrays["model/embed"].grid.boxes[0]
    cache = tmp_path / "cache"
    for k in (0, 1):  # rows 0..7 cached; chunk 1 with a flipped bit
        dest = _chunk_file(cache, box.chunks[k])
        dest.parent.mkdir(parents=True, exist_ok=True)
        raw = bytearray(_chunk_file(store_dir, box.chunks[k]).read_bytes())
        if k == 1:
            raw[7] ^= 0x10
        dest.write_bytes(bytes(raw))
    store = CheckpointStore(file_step, JOB, cache_dir=cache)
    rows = zarr.open_group(store=store, mode="r")["model/embed"][0:12, :]
    assert np.array_equal(rows, global_state()["model"]["embed"][0:12].numpy())
    assert store.bytes_from == {"cache": 4096, "store": 2 * 4096}
    assert store.fetched_ids == [box.chunks[1], box.chunks[2]] or sorted(
        store.fetched_ids) == sorted([box.chunks[1], box.chunks[2]])


def test_reading_through_the_view_never_imports_torch(file_step: str) -> None:
    import subprocess
    import sys

    code = (
        "import sys, zarr\n"
        "from ckptd.zarr import CheckpointStore\n"
        f"g = zarr.open_group(store=CheckpointStore({file_step!r}, {JOB!r}), mode='r')\n"
        "assert list(g['model/ids'][0:5]) == [0, 1, 2, 3, 4]\n"
        "assert g['model/layers.0.attn.w'][0:2, 0:3].shape == (2, 3)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
