"""The zarr view, export, import and ``ckptd diff --values`` of torch's low-precision
dtypes (float8_e4m3fnuz, float8_e5m2fnuz, float8_e8m0fnu, float4_e2m1fn_x2). zarr has
no such types: like float8_e4m3fn they are their raw bytes as ``uint8`` (same shape),
the ``ckptd.dtype`` attribute naming the real one. Before, a step holding one could
not be saved, and a manifest naming one was "unknown dtype" to the view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr

from ckptd.client import Checkpointer
from ckptd.client.step_diff import diff_steps
from ckptd.client.step_import import import_checkpoint
from ckptd.client.zarr_export import export_step
from ckptd.testing.manifests import rank_manifest, tensor_entry
from ckptd.zarr.hierarchy import build

NAMES = ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    out = {}
    for name in NAMES:
        raw = torch.randint(0, 256, (96, 100), generator=g, dtype=torch.uint8)
        raw.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every bit pattern
        out[name] = raw.view(getattr(torch, name))
    return out


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("name", NAMES)
def test_the_view_holds_each_as_uint8_naming_its_dtype(name: str) -> None:
    e, _ = tensor_entry("m.q", name, [8, 4])
    h = build([rank_manifest("j", 1, 0, 1, [e], tree={"dict": [
        ["m", {"dict": [["q", {"tensor": "m.q"}]]}]]})])
    meta = h.metadata("m/q")
    assert meta is not None and meta["data_type"] == "uint8" and meta["shape"] == [8, 4]
    assert meta["attributes"]["ckptd"]["dtype"] == name
    assert "configuration" not in meta["codecs"][0]  # one byte: no endianness


def test_export_and_import_give_each_back_bitwise(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    state = _state()
    with Checkpointer(url, "lp", chunk_size=4096, shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, state).wait(60)
    export_step(url, "lp", tmp_path / "z")
    root = zarr.open_group(str(tmp_path / "z"), mode="r")
    for name, t in state.items():
        arr = root[name]
        assert isinstance(arr, zarr.Array)
        assert arr.dtype == np.uint8 and arr.shape == tuple(t.shape)
        assert arr.attrs["ckptd"]["dtype"] == name  # type: ignore[index]
        assert np.array_equal(np.asarray(arr[...]), _raw(t)), name
    # What the attribute says reads the values, as ml_dtypes has them.
    scales = np.asarray(root["float8_e8m0fnu"][...]).view(ml_dtypes.float8_e8m0fnu)
    assert scales.reshape(-1)[127] == 1.0 and scales.reshape(-1)[130] == 8.0
    import_checkpoint(tmp_path / "z", url, "back", 2, shm_dir=shm)
    with Checkpointer(url, "back", shm_dir=shm, serve_peers=False) as ckpt:
        got: dict[str, Any] = {}
        ckpt.restore(got)
    for name, t in state.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert np.array_equal(_raw(got[name]), _raw(t)), name


def test_diff_values_reads_mx_scales_and_fp4(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    ones = torch.full((64, 64), 127, dtype=torch.uint8)  # 2^0 in e8m0
    zeros = torch.zeros(64, 64, dtype=torch.uint8)  # +0.0 +0.0 in each fp4 byte
    a = {"s": ones.view(torch.float8_e8m0fnu), "q": zeros.view(torch.float4_e2m1fn_x2),
         "f": torch.full((64, 64), 2.0).to(torch.float8_e4m3fnuz)}
    b_s, b_q = ones.clone(), zeros.clone()
    b_s[3, 5] = 130  # 2^3: |8 - 1| = 7
    b_q[9, 1] = 0x70  # one nibble 0b0111 = 6.0 (e2m1), the other still 0
    b = {"s": b_s.view(torch.float8_e8m0fnu), "q": b_q.view(torch.float4_e2m1fn_x2),
         "f": torch.full((64, 64), 2.0).to(torch.float8_e4m3fnuz)}
    b["f"].view(-1)[7] = torch.tensor(-3.0).to(torch.float8_e4m3fnuz)
    with Checkpointer(url, "d", chunk_size=4096, shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, a).wait(60)
        ckpt.save(2, b).wait(60)
    diffs = {d.path: d for d in diff_steps(url, "d", 1, 2, values=True)}
    assert (diffs["s"].status, diffs["s"].max_abs, diffs["s"].max_rel) == ("changed", 7.0, 7.0)
    assert diffs["q"].status == "changed" and diffs["q"].max_abs == 6.0
    assert diffs["q"].max_rel == float("inf")
    assert (diffs["f"].max_abs, diffs["f"].max_rel) == (5.0, 2.5)
