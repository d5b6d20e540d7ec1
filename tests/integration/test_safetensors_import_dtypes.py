"""``ckptd import`` and dtypes. safetensors' low-precision dtypes (``F8_E8M0``, the
fnuz float8s, packed fp4 ``F4``) were refused ("ckptd's checkpoint format has no
float8_e8m0fnu"): the format now names them, and they import bitwise. A dtype the
format still lacks (``complex32``, from a torch.save file: safetensors holds none
now) is named with the tensor and what to do (found by a fresh-user probe: it said
"has dtype ..., which the format lacks", neither whose format nor what to do); both
ways it offers (the bits as uint8, ``exclude=``) import, the first bitwise."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer
from ckptd.client.step_import import import_checkpoint
from ckptd.errors import InvalidRequest

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()


def _odd(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(dtype)  # every bit pattern


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                  "float4_e2m1fn_x2"])
def test_a_low_precision_dtype_of_safetensors_imports_bitwise(tmp_path: Path, name: str
                                                              ) -> None:
    source = tmp_path / f"dt_{name}.safetensors"
    bits = _odd(getattr(torch, name)).view(16, 16)
    save_file({"ok": torch.ones(3), name: bits}, source)
    url = f"file://{tmp_path / 'store'}"
    done = runner.invoke(app, ["import", str(source), "--job", "dt", "--step", "111",
                               "--url", url])
    assert done.exit_code == 0, done.output
    assert "2 tensors," in done.output, done.output
    with Checkpointer(url, "dt", shm_dir=tmp_path / "shm") as ckpt:
        got: dict[str, torch.Tensor] = {}
        ckpt.restore(got)
    assert (got[name].dtype, got[name].shape) == (bits.dtype, bits.shape)
    assert torch.equal(got[name].view(torch.uint8), bits.view(torch.uint8))


def _chalf(n: int) -> torch.Tensor:
    with warnings.catch_warnings():  # ("ComplexHalf support is experimental")
        warnings.simplefilter("ignore", UserWarning)
        return torch.arange(4 * n, dtype=torch.uint8).view(torch.complex32)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_dtype_the_format_lacks_is_named_with_what_to_do(tmp_path: Path) -> None:
    source = tmp_path / "half.pt"
    torch.save({"ok": torch.ones(3), "c": _chalf(8)}, source)
    store = tmp_path / "store"
    done = runner.invoke(app, ["import", str(source), "--job", "dt", "--step", "111",
                               "--url", f"file://{store}"])
    assert done.exit_code == 2, done.output
    said = " ".join(done.output.split())
    assert f"'c' in {source} is complex32, and ckptd's checkpoint format has no complex32" \
        in said, said
    assert "t.view(torch.uint8)" in said and ".view(torch.complex32)" in said, said
    assert "ckptd import --exclude c;" in said, said
    # (and where the Python call is imported from: it named import_checkpoint alone)
    assert "ckptd.client.step_import.import_checkpoint(..., exclude=['c'])" in said, said
    assert "Traceback" not in said and len(done.output.strip().splitlines()) <= 3, said
    assert not (store / "jobs" / "dt").exists()
    # The way out the line gives, on the command line:
    done = runner.invoke(app, ["import", str(source), "--job", "dt", "--step", "111",
                               "--exclude", "c", "--url", f"file://{store}"])
    assert done.exit_code == 0, done.output
    assert "1 tensor," in done.output, done.output


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_both_ways_out_import(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    half = _chalf(5)
    ok = torch.arange(5.0)
    source = tmp_path / "half.pt"
    torch.save({"w": ok, "w.c": half}, source)
    # Left out by name:
    result = import_checkpoint(source, url, "left", 1, shm_dir=shm, exclude=["w.c"])
    assert result.tensors == 1
    with Checkpointer(url, "left", shm_dir=shm) as ckpt:
        got: dict[str, torch.Tensor] = {}
        ckpt.restore(got)
    assert list(got) == ["w"] and torch.equal(got["w"], ok)
    # Its bits as uint8, given back bitwise by a view:
    bits = tmp_path / "bits.pt"
    torch.save({"w": ok, "w.c": half.view(torch.uint8)}, bits)
    import_checkpoint(bits, url, "bits", 1, shm_dir=shm)
    with Checkpointer(url, "bits", shm_dir=shm) as ckpt:
        back: dict[str, torch.Tensor] = {}
        ckpt.restore(back)
    assert torch.equal(back["w.c"].view(torch.complex32).view(torch.uint8),
                       half.view(torch.uint8))
    # A prefix that leaves out nothing is a typo, said so.
    with pytest.raises(InvalidRequest, match="'w.cc' starts no name of a tensor"):
        import_checkpoint(source, url, "typo", 1, shm_dir=shm, exclude="w.cc")


def test_exclude_leaves_out_tensors_of_a_nested_state(tmp_path: Path, shm: Path) -> None:
    """A torch.save file's nested state: a mapping's entries go, a list's are refused
    (its later items would be renamed)."""
    url = f"file://{tmp_path / 'store'}"
    source = tmp_path / "state.pt"
    torch.save({"model": {"w": torch.ones(2), "b": torch.zeros(2)},
                "bufs": [torch.ones(1), torch.ones(1)], "epoch": 3}, source)
    import_checkpoint(source, url, "nest", 1, shm_dir=shm, exclude=("model.b",))
    with Checkpointer(url, "nest", shm_dir=shm) as ckpt:
        got: dict[str, object] = {}
        ckpt.restore(got)
    model = got["model"]
    assert got["epoch"] == 3 and isinstance(model, dict) and list(model) == ["w"]
    with pytest.raises(InvalidRequest, match="an item of a list"):
        import_checkpoint(source, url, "nest", 2, shm_dir=shm, exclude="bufs.0")
