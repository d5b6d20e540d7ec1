"""The safetensors export's layout, pure: sizes as Hugging Face writes them, its
split into files (checked against huggingface_hub's own), headers byte for byte
as ``safetensors.torch.save_file`` writes them, and which boxes are runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptd.client.dtypes import dtype_name
from ckptd.client.integrations.safetensors.layout import (
    GlobalTensor,
    box_is_run,
    index_bytes,
    layout_file,
    parse_size,
    plan_files,
    run_start,
)
from ckptd.errors import InvalidRequest


@pytest.mark.parametrize(("text", "size"), [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1.5KB", 1500), ("2GiB", 2 << 30),
    ("64MiB", 64 << 20), ("4096", 4096), ("10 mb", 10**7), (123, 123),
])
def test_sizes_read_as_hugging_face_writes_them(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(("number", "size"), [(1.5e9, 1_500_000_000), (4096.0, 4096),
                                            (np.int64(10), 10), (np.float64(2e3), 2000),
                                            (np.float32(4096), 4096), (np.float16(512), 512)])
def test_a_whole_number_of_bytes_is_a_size_whatever_its_type(number: object, size: int
                                                             ) -> None:
    """(Found by a probe: ``max_shard_size=1.5e9`` was a ``TypeError`` from ``re``.)"""
    assert parse_size(number) == size  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "five", "5XB", "-1", "0", "GB", "1.5B", "1.0000001KB",
                                  2.5, float("nan"), float("inf"), -3.0, True, [1], None])
def test_bad_sizes_are_a_usage_mistake(text: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_size(text)  # type: ignore[arg-type]
    # Named as the Python API's caller wrote it; the CLI names its option.
    assert "\n" not in str(info.value) and "max_shard_size" in str(info.value)
    assert "--" not in str(info.value)
    with pytest.raises(InvalidRequest, match="--max-shard-size"):
        parse_size(text, "--max-shard-size")  # type: ignore[arg-type]


def _tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
            ) -> GlobalTensor:
    return GlobalTensor(name, name, dtype_name(dtype), shape)


def test_the_split_is_huggingface_hubs() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 400, (60,), generator=g).tolist()
    state = {f"layer.{i}": torch.empty(n, 10) for i, n in enumerate(sizes)}
    state["huge"] = torch.empty(2000, 10)  # past the limit: alone in its file
    state["after"] = torch.empty(5, 10)
    for limit in (4000, 20_000, 10**9):
        ours = plan_files([_tensor(k, tuple(v.shape)) for k, v in state.items()], limit, {})
        hub = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        assert {p.filename: sorted(x.tensor.name for x in p.placed) for p in ours} == {
            f: sorted(ts) for f, ts in hub.filename_to_tensors.items()}
        index = json.loads(index_bytes(ours))
        assert index["weight_map"] == hub.tensor_to_filename
        assert index["metadata"]["total_size"] == hub.metadata["total_size"]


def test_a_file_is_byte_for_byte_what_save_file_writes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.weight": torch.randn(7, generator=g),
        "f8": torch.randn(9, generator=g).to(torch.float8_e5m2),
        "f8b": torch.randn(2, generator=g).to(torch.float8_e4m3fn),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "u8": torch.arange(11, dtype=torch.uint8),
        "i16": torch.arange(3, dtype=torch.int16),
        "u32": torch.arange(3, dtype=torch.int64).to(torch.uint32),
        "c": torch.ones(2, dtype=torch.complex64),
        "é name \"quoted\"\n": torch.ones(1),
    }
    for meta in ({}, {"format": "pt"}):
        plan = layout_file("x", [_tensor(k, tuple(v.shape), v.dtype) for k, v in
                                 tensors.items()], meta)
        data = b"".join(tensors[p.tensor.name].contiguous().view(-1).view(torch.uint8)
                        .numpy().tobytes() for p in plan.placed)
        save_file(tensors, tmp_path / "ref.safetensors", metadata=meta or None)
        assert plan.header + data == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize(("offsets", "shape", "global_shape", "run"), [
    ((0, 0), (4, 6), (8, 6), True),  # whole rows
    ((3, 2), (1, 3), (8, 6), True),  # part of one row
    ((3, 0), (2, 3), (8, 6), False),  # columns of two rows
    ((0, 2), (8, 4), (8, 6), False),  # Shard(1)
    ((1, 0, 0), (1, 2, 5), (4, 3, 5), True),  # whole rows of a 3-D slice
    ((1, 1, 0), (2, 1, 5), (4, 3, 5), False),
    ((0, 0), (0, 6), (8, 6), True),  # empty: nothing to place
    ((), (), (), True),  # 0-dim
])
def test_runs_are_boxes_whose_elements_are_consecutive(
    offsets: tuple[int, ...], shape: tuple[int, ...], global_shape: tuple[int, ...], run: bool
) -> None:
    assert box_is_run(offsets, shape, global_shape) is run
    if run and math.prod(shape):  # the run starts where C order puts its first element
        flat = torch.arange(math.prod(global_shape)).view(global_shape)
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))]
        assert box.reshape(-1)[0].item() == run_start(offsets, global_shape)
        assert torch.equal(box.reshape(-1), torch.arange(box.numel()) + box.reshape(-1)[0])


def test_low_precision_dtypes_are_byte_for_byte_what_save_file_writes(tmp_path: Path) -> None:
    """safetensors' own names (F8_E4M3FNUZ, F8_E5M2FNUZ, F8_E8M0, F4) in its own order,
    and an F4 shape in fp4 values: the last dimension twice torch's bytes."""
    from safetensors.torch import save_file

    def bits(n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.int64) % 256).to(torch.uint8).view(shape).view(dtype)

    tensors = {
        "e4": bits(9, (9,), torch.float8_e4m3fnuz),
        "e5": bits(6, (2, 3), torch.float8_e5m2fnuz),
        "scale": bits(12, (3, 4), torch.float8_e8m0fnu),
        "fp4": bits(40, (5, 8), torch.float4_e2m1fn_x2),
        "fp4_1d": bits(3, (3,), torch.float4_e2m1fn_x2),
        "fp4_empty": bits(0, (0, 4), torch.float4_e2m1fn_x2),
        "f8": bits(5, (5,), torch.float8_e4m3fn),
        "u8": torch.arange(7, dtype=torch.uint8),
        "mask": torch.tensor([True, False]),
        "w": torch.ones(3),
    }
    plan = layout_file("x", [_tensor(k, tuple(v.shape), v.dtype) for k, v in
                             tensors.items()], {"format": "pt"})
    data = b"".join(tensors[p.tensor.name].contiguous().view(-1).view(torch.uint8)
                    .numpy().tobytes() for p in plan.placed)
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert plan.header + data == (tmp_path / "ref.safetensors").read_bytes()
    head = json.loads(plan.header[8:])
    assert head["fp4"]["dtype"] == "F4" and head["fp4"]["shape"] == [5, 16]
    assert head["scale"]["dtype"] == "F8_E8M0"
