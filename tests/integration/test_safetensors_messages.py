"""What ``ckptd import`` and ``ckptd export --safetensors`` say when they cannot do
what was asked (found by a fresh-user probe): a diffusers directory's index is
read, not reported missing; counts of one are singular; several ``--exclude``
prefixes read as a sentence; a write refused by a read-only filesystem is not
answered with "free space there"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()


def _said(output: str) -> str:
    return " ".join(output.split())


def test_a_diffusers_directory_is_read_by_its_own_index(tmp_path: Path, shm: Path) -> None:
    """diffusers names its index ``diffusion_pytorch_model.safetensors.index.json``:
    the import said there was no ``model.safetensors.index.json`` and stopped."""
    folder = tmp_path / "unet"
    folder.mkdir()
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4, dtype=torch.int32)
    files = ["diffusion_pytorch_model-00001-of-00002.safetensors",
             "diffusion_pytorch_model-00002-of-00002.safetensors"]
    save_file({"conv.weight": a}, folder / files[0])
    save_file({"conv.bias": b}, folder / files[1])
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 40}, "weight_map": {"conv.weight": files[0],
                                                        "conv.bias": files[1]}}))
    url = f"file://{tmp_path / 'store'}"
    done = runner.invoke(app, ["import", str(folder), "--job", "unet", "--step", "1",
                               "--url", url])
    assert done.exit_code == 0, done.output
    with Checkpointer(url, "unet", shm_dir=shm) as ckpt:
        got: dict[str, torch.Tensor] = {}
        ckpt.restore(got)
    assert torch.equal(got["conv.weight"], a) and torch.equal(got["conv.bias"], b)
    # Two indexes are two checkpoints: both named, none guessed.
    (folder / "other.safetensors.index.json").write_text("{}")
    done = runner.invoke(app, ["import", str(folder), "--job", "unet", "--step", "2",
                               "--url", url])
    assert done.exit_code == 2, done.output
    said = _said(done.output)
    assert "diffusion_pytorch_model.safetensors.index.json, other.safetensors.index.json" \
        in said, said


def test_a_count_of_one_is_singular(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.ones(2), "extra": torch.zeros(2)}, folder / "m.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "m.safetensors"}}))
    done = runner.invoke(app, ["import", str(folder), "--job", "j", "--step", "1",
                               "--url", f"file://{tmp_path / 'store'}"])
    assert done.exit_code == 2, done.output
    said = _said(done.output)
    assert "m.safetensors holds 1 tensor that model.safetensors.index.json does not put " \
        "there (first: 'extra')" in said, said


def _save(url: str, shm: Path) -> None:
    with Checkpointer(url, "ex", shm_dir=shm) as c:
        c.save(1, {"a": {"w": torch.ones(3)}, "b": torch.zeros(2)}).wait(60)


@pytest.mark.parametrize(("args", "said"), [
    (["--exclude", "a.", "--exclude", "b"],
     "step 1 of ex has no tensor to export: every name starts with 'a.' or 'b', which "
     "--exclude leaves out (it holds 'a.w', 'b')"),
    (["--only", "c", "--only", "d"], "step 1 of ex holds no tensor starting with 'c' or 'd' "
     "to export (it holds 'a.w', 'b')"),
    (["--only", "a.", "--exclude", "a.w", "--exclude", "b"],
     "holds no tensor starting with 'a.' and not with 'a.w' or 'b' to export"),
])
def test_a_selection_of_nothing_is_said_as_a_sentence(tmp_path: Path, shm: Path,
                                                      args: list[str], said: str) -> None:
    """``--exclude a. --exclude b`` said "holds no tensor not with 'a.', 'b' to export"."""
    url = f"file://{tmp_path / 'store'}"
    _save(url, shm)
    done = runner.invoke(app, ["export", "ex", "1", "--safetensors", str(tmp_path / "out"),
                               *args, "--url", url])
    assert done.exit_code == 2, done.output
    assert said in _said(done.output), done.output
    assert not (tmp_path / "out").exists()


def _namespaces_unavailable() -> str | None:
    import os

    if os.geteuid() != 0:
        return "needs root, to mount a read-only tmpfs in a mount namespace of its own"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else "unshare --mount is refused here"


def test_a_read_only_filesystem_is_not_told_to_free_space(tmp_path: Path, shm: Path) -> None:
    """An existing empty directory on a read-only filesystem: the export said
    "Read-only file system; free space there or export elsewhere"."""
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    url = f"file://{tmp_path / 'store'}"
    _save(url, shm)
    disk = tmp_path / "disk"
    disk.mkdir()
    ckptd = Path(sys.executable).with_name("ckptd")
    script = (f'mount -t tmpfs -o size=1m tmpfs "{disk}" && mkdir "{disk}/out" && '
              f'mount -o remount,ro "{disk}" && '
              f'"{ckptd}" export ex 1 --safetensors "{disk}/out" --url "{url}"')
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=90)
    said = _said(proc.stdout + proc.stderr)
    assert proc.returncode == 2, said
    assert f"cannot write {disk}/out/model.safetensors" in said, said
    assert "Read-only file system; that filesystem is mounted read-only: export elsewhere" \
        in said, said
    assert "free space" not in said and "Traceback" not in said, said


def test_an_import_with_a_read_token_says_how_to_pass_another(tmp_path: Path) -> None:
    """``ckptd import ... --token <read token>`` advised passing a write token "as
    token= or CKPTD_TOKEN" (Python's words) for "this Checkpointer", which the
    command line's user never made."""
    from ckptd.tokens import create_token
    from tests.conftest import ServerProcess

    tokens = tmp_path / "tokens.json"
    read = create_token(tokens, "imp*", "read")[0]
    srv = ServerProcess(store=tmp_path / "store", token="ADMIN-token",
                        extra_args=["--tokens-file", str(tokens)])
    srv.start()
    try:
        save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
        proc = subprocess.run([str(Path(sys.executable).with_name("ckptd")), "import",
                               str(tmp_path / "w.safetensors"), "--job", "imp", "--step", "1",
                               "--url", srv.url, "--token", read],
                              capture_output=True, text=True, timeout=90)
    finally:
        srv.stop()
    said = _said(proc.stdout + proc.stderr)
    assert proc.returncode == 2, said
    assert "the token given may read job 'imp' but not write it" in said, said
    assert "ckptd token create --job imp --role write) with --token" in said, said
    assert "Checkpointer" not in said and "Traceback" not in said, said
    assert len((proc.stdout + proc.stderr).strip().splitlines()) <= 3, said
