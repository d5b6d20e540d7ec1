"""``ckptd export --safetensors`` of torch's low-precision dtypes, under the names
safetensors gives them: ``F8_E4M3FNUZ``, ``F8_E5M2FNUZ``, ``F8_E8M0`` (MX block
scales) and ``F4`` (packed fp4, whose header shape counts fp4 values: the last
dimension twice torch's). Files byte for byte what ``save_file`` writes, read back
bitwise by ``load_file``, imported back bitwise; a 0-d ``float4_e2m1fn_x2``, which
no ``F4`` shape can say, is refused in one line naming it. Before, the step could
not even be saved ("tensors of dtype ... cannot be checkpointed")."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer, Shard
from ckptd.client.integrations.safetensors import export_safetensors
from ckptd.client.step_import import import_checkpoint

pytestmark = pytest.mark.timeout(180)

runner = CliRunner()
JOB = "lp"
CHUNK = 4096
NAMES = {"float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
         "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4"}


def _bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern first, then random bytes (no arithmetic on these dtypes)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    raw[: min(n, 256)] = torch.arange(min(n, 256), dtype=torch.uint8)
    return raw.view(shape).view(dtype)


def full_state() -> dict[str, torch.Tensor]:
    state = {f"model.{name}": _bits((40, 130), getattr(torch, name), i)
             for i, name in enumerate(NAMES)}
    state["model.w"] = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    state["model.fp4_cols"] = _bits((33, 70), torch.float4_e2m1fn_x2, 9)  # by columns
    return state


def save_two_ranks(url: str, shm: Path) -> dict[str, torch.Tensor]:
    """fp4_cols split by columns (31 : 39 bytes), the rest replicated."""
    full = full_state()
    ckpts = [Checkpointer(url, JOB, rank=r, world_size=2, chunk_size=CHUNK, shm_dir=shm,
                          serve_peers=False) for r in range(2)]
    try:
        handles = []
        for r, c in enumerate(ckpts):
            cols = full["model.fp4_cols"][:, :31] if r == 0 else full["model.fp4_cols"][:, 31:]
            model: dict[str, Any] = {k.split(".", 1)[1]: v for k, v in full.items()}
            model["fp4_cols"] = cols.contiguous()
            handles.append(c.save(1, {"model": model}, shards={
                "model.fp4_cols": Shard((33, 70), (0, 0 if r == 0 else 31))}))
        assert "committed" in [h.wait(timeout=60).state for h in handles]
    finally:
        for c in ckpts:
            c.close()
    return full


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return dict(json.loads(data[8 : 8 + n]))


def test_export_names_each_dtype_as_safetensors_does_and_reads_back_bitwise(
    tmp_path: Path, shm: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    full = save_two_ranks(url, shm)
    result = export_safetensors(url, JOB, tmp_path / "out")
    assert result.tensors == len(full)
    out = tmp_path / "out" / "model.safetensors"
    head = _header(out)
    for name, st in NAMES.items():
        assert head[f"model.{name}"]["dtype"] == st
    # An F4 shape counts fp4 values: torch's [40, 130] bytes are [40, 260] values.
    assert head["model.float4_e2m1fn_x2"]["shape"] == [40, 260]
    assert head["model.fp4_cols"]["shape"] == [33, 140]
    assert head["model.float8_e8m0fnu"]["shape"] == [40, 130]
    back = load_file(out)
    for name, t in full.items():
        assert (back[name].dtype, back[name].shape) == (t.dtype, t.shape), name
        assert _raw(back[name]) == _raw(t), name
    # Byte for byte what safetensors itself writes of the same tensors.
    places = json.dumps({name: name.split(".", 1) for name in full}, separators=(",", ":"))
    save_file(full, tmp_path / "ref.safetensors",
              metadata={"format": "pt", "ckptd.job": JOB, "ckptd.step": "1",
                        "ckptd.paths": places})
    ref = (tmp_path / "ref.safetensors").read_bytes()
    ours = out.read_bytes()
    (n_ours,), (n_ref,) = struct.unpack("<Q", ours[:8]), struct.unpack("<Q", ref[:8])
    assert n_ours == n_ref and ours[8 + n_ours:] == ref[8 + n_ref:]
    assert head == _header(tmp_path / "ref.safetensors")
    # And imported back, each tensor is its dtype and bits again.
    import_checkpoint(tmp_path / "out", url, "back", 1, shm_dir=shm)
    with Checkpointer(url, "back", shm_dir=shm, serve_peers=False) as ckpt:
        got: dict[str, Any] = {}
        ckpt.restore(got)
    for name, t in full.items():
        group, key = name.split(".", 1)
        mine = got[group][key]
        assert (mine.dtype, mine.shape, _raw(mine)) == (t.dtype, t.shape, _raw(t)), name


def test_a_0d_fp4_is_refused_in_one_line_naming_it(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    lone = torch.tensor(0x21, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with Checkpointer(url, "z", shm_dir=shm, serve_peers=False) as c:
        c.save(1, {"w": torch.ones(3), "q": lone}).wait(60)
    done = runner.invoke(app, ["export", "z", "--safetensors", str(tmp_path / "x"),
                               "--url", url])
    said = " ".join(done.output.split())
    assert done.exit_code == 2, done.output
    assert "'q' is a 0-d float4_e2m1fn_x2" in said and "--exclude q" in said, said
    assert "Traceback" not in done.output and len(done.output.strip().splitlines()) <= 3
    assert not (tmp_path / "x").exists()
    done = runner.invoke(app, ["export", "z", "--safetensors", str(tmp_path / "x"),
                               "--exclude", "q", "--url", url])
    assert done.exit_code == 0, done.output
    assert sorted(load_file(tmp_path / "x" / "model.safetensors")) == ["w"]
