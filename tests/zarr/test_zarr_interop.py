"""Export to plain zarr, import from zarr / DCP / torch.save, and diff of two steps."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer
from ckptd.client.step_diff import diff_steps
from ckptd.client.step_import import import_checkpoint
from ckptd.client.zarr_export import export_step
from ckptd.errors import InvalidRequest, UnsupportedValue
from tests.conftest import ServerProcess
from tests.store.test_s3 import BUCKET, endpoint  # noqa: F401 - the moto server fixture
from tests.zarr.conftest import JOB, as_numpy, global_state, save_step
from tests.zarr.test_zarr_view import CountingTransport, _tensors

runner = CliRunner()

# Runs with no site (so no editable-install hook) and only site-packages on the
# path: zarr is importable, ckptd is not.
READER = """
import hashlib, importlib.util, json, sys
sys.path[:] = [p for p in sys.argv[2:]]
assert importlib.util.find_spec("ckptd") is None, "ckptd must not be importable here"
import zarr
root = zarr.open_group(sys.argv[1], mode="r")
out = {}
def walk(group, prefix):
    for name, member in group.members():
        path = prefix + name
        if isinstance(member, zarr.Group):
            walk(member, path + "/")
        else:
            a = member[...]
            out[path] = [str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest(),
                         member.attrs.get("ckptd", {}).get("dtype")]
walk(root, "")
out["_epoch"] = root.attrs["epoch"]
print(json.dumps(out))
"""


def _read_without_ckptd(directory: Path, cwd: Path) -> dict[str, Any]:
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths += [p for p in sys.path if p.endswith(("lib-dynload", ".zip")) or
              p.rstrip("/").endswith(f"python{sys.version_info[0]}.{sys.version_info[1]}")]
    proc = subprocess.run([sys.executable, "-S", "-c", READER, str(directory), *paths],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def _expected() -> dict[str, Any]:
    out = {}
    for path, t in _tensors(global_state()).items():
        a = as_numpy(t)
        out[path] = [str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest(),
                     "bfloat16" if t.dtype == torch.bfloat16 else str(a.dtype)]
    return out


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_export_opens_in_plain_zarr_without_ckptd(file_step: str, tmp_path: Path,
                                                  codec: str | None) -> None:
    target = tmp_path / "export"
    result = export_step(file_step, JOB, target, codec=codec)
    assert result.step == 1 and result.arrays == 7
    seen = _read_without_ckptd(target, tmp_path)
    assert seen.pop("_epoch") == 3
    assert seen == _expected()
    if codec:
        meta = json.loads((target / "model" / "embed" / "zarr.json").read_text())
        assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]


def test_export_refuses_a_directory_that_is_not_empty(file_step: str, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidRequest):
        export_step(file_step, JOB, tmp_path / "full")


@pytest.mark.parametrize("existing", [False, True])
def test_a_write_that_fails_gets_one_line_and_leaves_no_half_hierarchy(
        file_step: str, tmp_path: Path, existing: bool) -> None:
    """A write the filesystem refuses (the file size limit, ``ulimit -f``, as a full
    disk or a quota would): one line naming the directory, exit 2, and nothing of
    the export left, whether it made the directory or was given an empty one."""
    import resource
    import signal

    target = tmp_path / "z"
    if existing:
        target.mkdir()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # below a chunk file

    ckptd = Path(sys.executable).with_name("ckptd")
    proc = subprocess.run([str(ckptd), "export", JOB, "1", "--zarr", str(target), "--url",
                           file_step], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, said
    assert f"cannot write into {target}: File too large; a file passed the size limit" \
        in said and "free space" not in said, said
    assert "Traceback" not in said and len(proc.stderr.strip().splitlines()) <= 3, said
    assert target.exists() == existing
    assert not existing or not any(target.iterdir()), list(target.iterdir())


def _restored(url: str, job: str, step: int) -> dict[str, Any]:
    with Checkpointer(url, job, serve_peers=False) as ckpt:
        state: dict[str, Any] = {}
        ckpt.restore(state, step=step)
        return state


def _assert_bitwise(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise(x, y)
    else:
        assert a == b or (a != a and b != b)


def test_export_imports_back_as_the_same_chunks(file_step: str, tmp_path: Path,
                                                shm: Path) -> None:
    export_step(file_step, JOB, tmp_path / "export")
    result = import_checkpoint(tmp_path / "export", file_step, JOB, 2, shm_dir=shm,
                               chunk_size=4096)
    assert result.kind == "zarr" and result.tensors == 7
    _assert_bitwise(_restored(file_step, JOB, 2), global_state())
    diffs = diff_steps(file_step, JOB, 1, 2)
    # One rank's contiguous bf16 tensor is chunked like the two shards were only
    # where rows line up; everything else is the very same chunks.
    same = {d.path for d in diffs if d.status == "same"}
    assert same >= {"model/embed", "model/ids", "model/mask", "count", "optim/state/0/exp_avg"}
    with pytest.raises(InvalidRequest):  # the step exists: never overwritten
        import_checkpoint(tmp_path / "export", file_step, JOB, 2, shm_dir=shm)


def test_import_of_a_dcp_directory_restores_bitwise(tmp_path: Path, shm: Path) -> None:
    state = {"model": {"w": torch.randn(33, 17).to(torch.bfloat16), "b": torch.arange(9)},
             "optim": {"state": {"m": torch.randn(5, dtype=torch.float64)}, "lr": 0.5}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    url = f"file://{tmp_path / 'store'}"
    result = import_checkpoint(tmp_path / "dcp", url, "fromdcp", 100, shm_dir=shm)
    assert result.kind == "dcp" and result.tensors == 3
    _assert_bitwise(_restored(url, "fromdcp", 100), state)


def test_import_of_a_torch_save_file_restores_bitwise(tmp_path: Path, shm: Path) -> None:
    state = {"w": torch.randn(10, 3), "step": 7,
             "nested": {"t": (torch.ones(2, dtype=torch.int8),)}}
    torch.save(state, tmp_path / "ckpt.pt")
    url = f"file://{tmp_path / 'store'}"
    result = import_checkpoint(tmp_path / "ckpt.pt", url, "fromtorch", 3, shm_dir=shm)
    assert result.kind == "torch"
    _assert_bitwise(_restored(url, "fromtorch", 3), state)


class Evil:
    def __reduce__(self) -> Any:
        return (print, ("unpickled!",))


def test_import_never_unpickles_objects(tmp_path: Path, shm: Path) -> None:
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(UnsupportedValue):
        import_checkpoint(tmp_path / "evil.pt", f"file://{tmp_path / 's'}", "e", 1, shm_dir=shm)


def test_diff_counts_shared_chunks_and_reads_only_changed_ones(tmp_path: Path,
                                                               shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    a = {"w": torch.zeros(64, 256), "b": torch.ones(8), "gone": torch.ones(1)}
    b = {"w": a["w"].clone(), "b": torch.ones(8), "new": torch.ones(1)}
    b["w"][10, 3] = 2.0  # one 4 KiB chunk of sixteen
    b["w"][10, 4] = -0.5
    with Checkpointer(url, "d", chunk_size=4096, shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, a).wait()
        ckpt.save(2, b).wait()
    counting = CountingTransport(str(tmp_path / "store"))
    diffs = {d.path: d for d in diff_steps(url, "d", 1, 2, values=True, transport=counting)}
    assert len(counting.asked) == 2  # the one changed chunk, in each step; nothing else
    assert diffs["w"].status == "changed" and (diffs["w"].shared_chunks, diffs["w"].chunks) == (
        15, 16)
    assert diffs["w"].max_abs == 2.0 and diffs["w"].max_rel == float("inf")
    assert diffs["b"].status == "same" and diffs["b"].max_abs == 0.0
    assert diffs["gone"].status == "removed" and diffs["new"].status == "added"
    # --exit-code: 1 when a tensor differs, as git diff's (found by a probe: a script
    # could not tell two steps apart by the exit code)
    for steps, code in ((["1", "2"], 1), (["2", "2"], 0)):
        out = runner.invoke(app, ["diff", "d", *steps, "--exit-code", "--url", url])
        assert out.exit_code == code and "tensors differ" in out.output, out.output


@pytest.mark.slow
def test_cli_export_import_and_diff_against_a_server(server: ServerProcess,
                                                     tmp_path: Path) -> None:
    save_step(server.url)
    out = runner.invoke(app, ["export", JOB, "1", "--zarr", str(tmp_path / "z"),
                              "--codec", "zstd", "--url", server.url])
    assert out.exit_code == 0, out.output
    assert "7 arrays" in out.output
    out = runner.invoke(app, ["import", str(tmp_path / "z"), "--job", "copy", "--step", "5",
                              "--url", server.url])
    assert out.exit_code == 0, out.output
    _assert_bitwise(_restored(server.url, "copy", 5), global_state())
    out = runner.invoke(app, ["diff", JOB, "1", "1", "--values", "--url", server.url])
    assert out.exit_code == 0, out.output
    assert "0 of 7 tensors differ" in out.output
    out = runner.invoke(app, ["import", str(tmp_path / "nothing"), "--job", "copy", "--step",
                              "6", "--url", server.url])
    assert out.exit_code == 2 and "does not exist" in " ".join(out.output.split())
    assert "Traceback" not in out.output


def test_every_dtype_reads_exports_and_imports_back_bitwise(tmp_path: Path, shm: Path) -> None:
    from ckptd.client.dtypes import _DTYPE_NAMES
    from ckptd.dtypes import ITEMSIZE
    from ckptd.zarr import CheckpointStore

    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {}
    for dtype, name in _DTYPE_NAMES.items():
        raw = torch.randint(0, 256, (5, 7 * ITEMSIZE[name]), dtype=torch.uint8, generator=g)
        t = raw.view(dtype) if dtype != torch.bool else raw % 2 == 1
        state[name] = t.clone()
    assert set(state) == set(ITEMSIZE)  # every dtype ckptd stores
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "dt", chunk_size=4096, shm_dir=shm, serve_peers=False) as ckpt:
        assert ckpt.save(1, state).wait().state == "committed"
    import zarr

    root = zarr.open_group(store=CheckpointStore(url, "dt"), mode="r")
    for name, t in state.items():
        got = root[name][...]
        assert got.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert root[name].attrs["ckptd"]["dtype"] == name
    export_step(url, "dt", tmp_path / "z")
    import_checkpoint(tmp_path / "z", url, "dt", 2, shm_dir=shm)
    _assert_bitwise(_restored(url, "dt", 2), state)


@pytest.mark.slow
def test_export_to_s3_is_plain_zarr(
    file_step: str, tmp_path: Path, endpoint: str  # noqa: F811 - the moto fixture
) -> None:
    """Export under an s3:// prefix (moto's real server); the objects, copied to a
    directory as they are, open in plain zarr without ckptd."""
    import boto3

    prefix = f"zarr/{tmp_path.name}"
    target = f"s3://{BUCKET}/{prefix}?endpoint={endpoint}"
    result = export_step(file_step, JOB, target, codec="zstd")
    assert result.arrays == 7
    with pytest.raises(InvalidRequest):  # never into a prefix that holds something
        export_step(file_step, JOB, target)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    local = tmp_path / "copy"
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            dest = local / obj["Key"][len(prefix) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
    seen = _read_without_ckptd(local, tmp_path)
    assert seen.pop("_epoch") == 3
    assert seen == _expected()


def test_import_of_a_plain_zarr_group(tmp_path: Path, shm: Path) -> None:
    """A zarr hierarchy ckptd did not write: groups as dicts, arrays as tensors,
    attributes as values."""
    import numpy as np
    import zarr

    root = zarr.open_group(str(tmp_path / "plain"), mode="w", attributes={"epoch": 4})
    enc = root.create_group("encoder", attributes={"note": "hi"})
    w = enc.create_array("w", shape=(6, 5), chunks=(4, 5), dtype="float32")
    w[...] = np.arange(30, dtype=np.float32).reshape(6, 5)
    b = root.create_array("b", shape=(3,), chunks=(3,), dtype="int16")
    b[...] = [1, -2, 3]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "zarr.json").write_text("{not json")
    url = f"file://{tmp_path / 'store'}"
    result = import_checkpoint(tmp_path / "plain", url, "plain", 1, shm_dir=shm)
    assert result.kind == "zarr" and result.tensors == 2
    _assert_bitwise(_restored(url, "plain", 1), {
        "epoch": 4, "b": torch.tensor([1, -2, 3], dtype=torch.int16),
        "encoder": {"note": "hi", "w": torch.arange(30, dtype=torch.float32).reshape(6, 5)},
    })
    with pytest.raises(InvalidRequest):
        import_checkpoint(tmp_path / "broken", url, "plain", 2, shm_dir=shm)


class Planted:
    """Unpickling it creates a file: proof that something ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (str(self.marker), "w"))


def test_import_of_a_dcp_directory_never_unpickles_its_values(tmp_path: Path,
                                                               shm: Path) -> None:
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "obj": Planted(marker)}, checkpoint_id=str(tmp_path / "dcp"),
             no_dist=True)
    with pytest.raises(UnsupportedValue):
        import_checkpoint(tmp_path / "dcp", f"file://{tmp_path / 's'}", "e", 1, shm_dir=shm)
    assert not marker.exists()


def test_a_step_holding_raw_bytes_is_viewed_exported_diffed_and_imported_back(
    tmp_path: Path, shm: Path
) -> None:
    """Found by a probe: a step with a ``bytes`` value (or a DCP ``BytesIO`` item)
    failed the zarr view, ``export --zarr`` and ``diff`` with a traceback (the view
    walked the blob's name as a container). A blob is its 1-D uint8 entry's array."""
    import zarr

    from ckptd.zarr import CheckpointStore

    url = f"file://{tmp_path / 'store'}"
    blob = bytes(range(256)) * 40
    with Checkpointer(url, "blob", chunk_size=4096, shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(4), "extra": {"raw": blob}}).wait()
        ckpt.save(2, {"w": torch.ones(4), "extra": {"raw": blob[::-1]}}).wait()
    root = zarr.open_group(store=CheckpointStore(url, "blob", step=1), mode="r")
    assert root["extra/raw"][...].tobytes() == blob
    export_step(url, "blob", tmp_path / "export", 1)
    assert zarr.open_group(str(tmp_path / "export"), mode="r")["extra/raw"][...].tobytes() \
        == blob
    diffs = {d.path: d.status for d in diff_steps(url, "blob", 1, 2)}
    assert diffs == {"w": "same", "extra/raw": "changed"}, diffs
    result = import_checkpoint(tmp_path / "export", url, "blob", 3, shm_dir=shm)
    assert result.kind == "zarr"
    got = _restored(url, "blob", 3)
    assert got["extra"]["raw"] == blob and torch.equal(got["w"], torch.ones(4))
