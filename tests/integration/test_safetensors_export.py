"""``ckptd export --safetensors`` and ``ckptd import`` of safetensors: a two-rank
step with rows, columns, uneven and empty shards, bf16 and float8, exported over
``file://`` and through a real server, read back by ``safetensors`` in a process
where ckptd is not importable, filtered, round-tripped, and refused clearly."""

from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer, Shard
from ckptd.client.integrations.safetensors import export_safetensors
from ckptd.client.step_import import import_checkpoint
from ckptd.errors import ChunkHashMismatch, InvalidRequest, UnsupportedValue

pytestmark = pytest.mark.timeout(180)

runner = CliRunner()
JOB = "st"
CHUNK = 4096


def full_state() -> dict[str, torch.Tensor]:
    """The global tensors the two ranks hold parts of (names as the export writes them)."""
    g = torch.Generator().manual_seed(3)
    return {
        "model.rows": torch.randn(10, 600, generator=g).to(torch.bfloat16),  # uneven rows
        "model.cols": torch.randn(50, 80, generator=g),  # split by columns, 3 : 5
        "model.f8": torch.randn(3000, generator=g).to(torch.float8_e4m3fn),
        "model.big": torch.randn(64, 100, generator=g),  # replicated, several chunks
        "model.one_rank": torch.randn(4, 4, generator=g),  # rank 1 holds an empty box
        "optim.exp_avg": torch.randn(33, 70, generator=g),  # columns, uneven
        "optim.step": torch.tensor(12.0),
        "optim.count": torch.arange(70, dtype=torch.int64),
    }


# name -> (rank 0's box, rank 1's box) as (offsets, shape); absent: replicated
BOXES: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = {
    "model.rows": (((0, 0), (7, 600)), ((7, 0), (3, 600))),
    "model.cols": (((0, 0), (50, 30)), ((0, 30), (50, 50))),
    "model.one_rank": (((0, 0), (4, 4)), ((4, 0), (0, 4))),
    "optim.exp_avg": (((0, 0), (33, 31)), ((0, 31), (33, 39))),
}


def _box(t: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))].clone()


def rank_state(full: dict[str, torch.Tensor], r: int) -> tuple[dict[str, Any], dict[str, Shard]]:
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    shards: dict[str, Shard] = {}
    for name, t in full.items():
        group, key = name.split(".", 1)
        value = t
        if name in BOXES:
            offsets, shape = BOXES[name][r]
            value = _box(t, offsets, shape)
            shards[name] = Shard(tuple(t.shape), offsets)
        (model if group == "model" else optim)[key] = value
    rng = torch.full((8,), r, dtype=torch.uint8)  # rank-local: no global tensor
    # A bytes leaf is an opaque blob, no tensor: the export leaves it out.
    return {"model": model, "optim": optim, "rng": rng, "epoch": 3, "raw": b"\x80opaque"}, shards


def save_two_ranks(url: str, shm: Path, job: str = JOB, step: int = 1) -> dict[str, torch.Tensor]:
    full = full_state()
    ckpts = [Checkpointer(url, job, rank=r, world_size=2, chunk_size=CHUNK, shm_dir=shm,
                          serve_peers=False) for r in range(2)]
    try:
        handles = []
        for r, c in enumerate(ckpts):
            state, shards = rank_state(full, r)
            handles.append(c.save(step, state, shards=shards, local=["rng"]))
        assert "committed" in [h.wait(timeout=60).state for h in handles]
    finally:
        for c in ckpts:
            c.close()
    return full


# Runs with no site (so no editable-install hook) and only site-packages on the
# path: safetensors and torch are importable, ckptd is not.
READER = """
import hashlib, importlib.util, json, sys
paths = sys.argv[2:]
sys.path[:] = paths
assert importlib.util.find_spec("ckptd") is None, "ckptd must not be importable here"
import os
from safetensors.torch import load_file
index = json.load(open(os.path.join(sys.argv[1], "model.safetensors.index.json")))
out = {}
for name, filename in index["weight_map"].items():
    t = load_file(os.path.join(sys.argv[1], filename))[name]
    raw = t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
    out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
print(json.dumps({"tensors": out, "total": index["metadata"]["total_size"]}))
"""


def site_paths() -> list[str]:
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return paths + [p for p in sys.path if p.endswith(("lib-dynload", ".zip")) or
                    p.rstrip("/").endswith(f"python{sys.version_info[0]}.{sys.version_info[1]}")]


def read_without_ckptd(directory: Path, cwd: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-S", "-c", READER, str(directory), *site_paths()],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def fingerprint(t: torch.Tensor) -> list[Any]:
    import hashlib

    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return fingerprint(a) == fingerprint(b)


def test_export_of_two_ranks_reads_in_safetensors_without_ckptd(tmp_path: Path, shm: Path
                                                                ) -> None:
    url = f"file://{tmp_path / 'store'}"
    full = save_two_ranks(url, shm)
    seen: list[tuple[int, int]] = []
    # Small files and windows: many files, windows cut inside tensors, column slabs.
    result = export_safetensors(url, JOB, tmp_path / "out", max_shard_size="20KB",
                                window=8192, on_bytes=lambda d, t: seen.append((d, t)))
    assert result.step == 1 and result.tensors == len(full)
    assert result.skipped_local == ["rng"]  # rank-local state is no global tensor
    assert len(result.files) > 3 and result.files[0] == f"model-00001-of-{len(result.files):05d}" \
        ".safetensors"
    out = read_without_ckptd(tmp_path / "out", tmp_path)
    assert out["tensors"] == {name: fingerprint(t) for name, t in full.items()}
    assert out["total"] == sum(t.numel() * t.element_size() for t in full.values())
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert files == {*result.files, "model.safetensors.index.json"}  # no temporaries left
    # Progress counts up to every byte of every file.
    assert seen[-1][0] == seen[-1][1] == sum((tmp_path / "out" / f).stat().st_size
                                             for f in result.files)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False))
    # Every file: no file but a lone large tensor passes the limit.
    for f in result.files:
        loaded = load_file(tmp_path / "out" / f)
        size = sum(t.numel() * t.element_size() for t in loaded.values())
        assert size <= 20_000 or len(loaded) == 1


def test_file_bytes_are_what_save_file_writes(tmp_path: Path, shm: Path) -> None:
    from safetensors.torch import save_file

    url = f"file://{tmp_path / 'store'}"
    full = save_two_ranks(url, shm)
    export_safetensors(url, JOB, tmp_path / "out")  # one file: model.safetensors
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    places = json.dumps({name: name.split(".", 1) for name in full}, separators=(",", ":"))
    meta = {"format": "pt", "ckptd.job": JOB, "ckptd.step": "1", "ckptd.paths": places}
    save_file(full, tmp_path / "ref.safetensors", metadata=meta)
    ref = (tmp_path / "ref.safetensors").read_bytes()
    # save_file orders __metadata__'s keys as a hash map does, so the headers are
    # compared parsed; the tensors' layout and every data byte are compared whole.
    (n_ours,), (n_ref,) = struct.unpack("<Q", ours[:8]), struct.unpack("<Q", ref[:8])
    assert n_ours == n_ref and ours[8 + n_ours:] == ref[8 + n_ref:]
    assert json.loads(ours[8:8 + n_ours]) == json.loads(ref[8:8 + n_ref])
    head = json.loads(ours[8:8 + n_ours])
    assert list(head)[0] == "__metadata__"


def test_cli_export_through_a_server_with_only_and_strip(tmp_path: Path, shm: Path,
                                                          server: Any) -> None:
    full = save_two_ranks(server.url, shm)
    done = runner.invoke(app, ["export", JOB, "1", "--safetensors", str(tmp_path / "m"),
                               "--only", "model.", "--strip", "model.", "--url", server.url])
    assert done.exit_code == 0, done.output
    assert "5 tensors" in done.output and "verified" in done.output
    got = load_file(tmp_path / "m" / "model.safetensors")
    want = {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}
    assert sorted(got) == sorted(want)
    assert all(same_bits(got[k], want[k]) for k in want)
    # Two prefixes, no strip; the latest step when none is named.
    done = runner.invoke(app, ["export", JOB, "--safetensors", str(tmp_path / "o"), "--only",
                               "optim.step", "--only", "model.f8", "--url", server.url])
    assert done.exit_code == 0, done.output
    assert sorted(load_file(tmp_path / "o" / "model.safetensors")) == ["model.f8", "optim.step"]


def test_a_string_only_is_one_prefix(tmp_path: Path, shm: Path) -> None:
    """(Found by a probe.) ``only="model."`` was iterated per character, as the
    prefixes m, o, d, e, l and ".": the export silently held ``optim.*`` too."""
    url = f"file://{tmp_path / 'store'}"
    full = save_two_ranks(url, shm)
    result = export_safetensors(url, JOB, tmp_path / "out", only="model.", strip="model.")
    want = sorted(k.removeprefix("model.") for k in full if k.startswith("model."))
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == want
    assert result.tensors == len(want)


def test_an_only_or_exclude_that_is_no_prefix_is_refused_in_one_line(
        tmp_path: Path, shm: Path, server: Any) -> None:
    """(Found by a probe.) ``only=5`` raised ``TypeError: 'int' object is not
    iterable`` from inside the export (bytes were iterated as numbers, a mapping
    as its keys); a str is one prefix, as the CLI's repeatable ``--only`` is."""
    save_two_ranks(server.url, shm)
    for how in ("only", "exclude"):
        for given in (5, b"model.", {"model.": 1}):
            with pytest.raises(InvalidRequest) as info:
                export_safetensors(server.url, JOB, tmp_path / "out", **{how: given})
            said = str(info.value)
            assert said.startswith(f"{how}= takes a name prefix (a str"), said
            assert type(given).__name__ in said and "\n" not in said
            assert not (tmp_path / "out").exists()
    # A str, a list and a set of str are prefixes.
    for i, ok in enumerate(["model.f8", ["model.f8"], {"model.f8"}]):
        result = export_safetensors(server.url, JOB, tmp_path / f"ok{i}", only=ok)
        assert sorted(load_file(tmp_path / f"ok{i}" / "model.safetensors")) == ["model.f8"]
        assert result.tensors == 1


def test_import_of_an_export_round_trips_bitwise(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    full = save_two_ranks(url, shm)
    export_safetensors(url, JOB, tmp_path / "a", max_shard_size="30KB")
    done = runner.invoke(app, ["import", str(tmp_path / "a"), "--job", "back", "--step", "5",
                               "--url", url])
    assert done.exit_code == 0, done.output
    assert "safetensors checkpoint" in done.output and "bitwise" in done.output
    with Checkpointer(url, "back", shm_dir=shm) as ckpt:
        nested: dict[str, Any] = {}
        assert ckpt.restore(nested).step == 5
    # (back at their places: {"model": {"rows": ...}, "optim": {...}}, as saved)
    restored = {f"{g}.{k}": t for g, group in nested.items() for k, t in group.items()}
    assert sorted(restored) == sorted(full)
    assert all(same_bits(restored[k], full[k]) for k in full)
    # The imported step exports to the same tensors again (the files may group them
    # otherwise: safetensors keeps no state-dict order for the import to take).
    second = export_safetensors(url, "back", tmp_path / "b", max_shard_size="30KB")
    again: dict[str, torch.Tensor] = {}
    for f in second.files:
        again.update(load_file(tmp_path / "b" / f))
    assert sorted(again) == sorted(full) and all(same_bits(again[k], full[k]) for k in full)
    # A single .safetensors file is a checkpoint too.
    one = tmp_path / "one.safetensors"
    from safetensors.torch import save_file

    save_file({"w": full["model.cols"], "h": full["model.rows"]}, one)
    result = import_checkpoint(one, url, "single", 1, shm_dir=shm)
    assert (result.kind, result.tensors) == ("safetensors", 2)


def test_a_corrupt_chunk_fails_the_export_naming_it_and_leaves_nothing(tmp_path: Path,
                                                                       shm: Path) -> None:
    store = tmp_path / "store"
    save_two_ranks(f"file://{store}", shm)
    manifest = json.loads((store / f"jobs/{JOB}/steps/1/ranks/1.json").read_text())
    entry = next(e for e in manifest["entries"] if e["name"] == "model.rows")
    victim = store / "chunks" / entry["chunks"][0][:2] / entry["chunks"][0]
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    target = tmp_path / "out"
    with pytest.raises(ChunkHashMismatch) as info:
        export_safetensors(f"file://{store}", JOB, target, max_shard_size="20KB")
    assert "'model.rows'" in str(info.value)
    assert not target.exists()  # no partial export behind
    done = runner.invoke(app, ["export", JOB, "1", "--safetensors", str(target),
                               "--url", f"file://{store}"])
    assert done.exit_code == 1 and "chunk_hash_mismatch" in done.output  # damage found
    assert "Traceback" not in done.output and len(done.output.strip().splitlines()) <= 3


def test_a_failed_export_writes_nothing_after_its_file_is_closed(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by review.) A window is written while the next one fills; when the
    next one fails, the write under way must end before the file's descriptor
    closes: its later pwrites would go to a closed descriptor, or to whatever file
    the process opened next under that number."""
    from ckptd.client.integrations.safetensors import export as export_module

    store = tmp_path / "store"
    save_two_ranks(f"file://{store}", shm)
    manifest = json.loads((store / f"jobs/{JOB}/steps/1/ranks/1.json").read_text())
    entry = next(e for e in manifest["entries"] if e["name"] == "model.cols")
    victim = store / "chunks" / entry["chunks"][-1][:2] / entry["chunks"][-1]
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))  # the last rows of rank 1's columns are bad
    real = export_module._write_all
    writes: list[bool] = []  # per write: was the descriptor still open when it ran

    def slow_write(fd: int, view: memoryview, offset: int) -> None:
        time.sleep(1.0)  # a slow disk: the next window fills and fails meanwhile
        try:
            os.fstat(fd)
            writes.append(True)
        except OSError:
            writes.append(False)
        real(fd, view, offset)

    monkeypatch.setattr(export_module, "_write_all", slow_write)
    with pytest.raises(ChunkHashMismatch):
        # model.cols alone, in slabs of 12 rows: the 4th slab needs the bad chunk.
        export_safetensors(f"file://{store}", JOB, tmp_path / "out", only=["model.cols"],
                           window=4096)
    time.sleep(1.5)  # (a write left running would have run by now)
    gc.collect()  # (and its future's "never retrieved" report is logged now, not later)
    assert len(writes) >= 2 and all(writes), writes
    assert not (tmp_path / "out").exists()


def test_an_export_whose_renames_fail_midway_leaves_no_file(tmp_path: Path, shm: Path) -> None:
    """(Found by review.) Into an existing empty directory the files are renamed up
    from the export's staging directory one by one; when one rename fails, the files
    renamed before it go too."""
    url = f"file://{tmp_path / 'store'}"
    save_two_ranks(url, shm)
    target = tmp_path / "out"
    target.mkdir()

    def on_bytes(done: int, total: int) -> None:
        if done == total:  # every file written: someone takes the last file's name
            (staging,) = target.glob("out.partial-*")
            last = sorted(p.name for p in staging.glob("*.safetensors"))[-1]
            (target / last).mkdir()

    with pytest.raises(InvalidRequest, match="written by another program"):
        export_safetensors(url, JOB, target, max_shard_size="20KB", on_bytes=on_bytes)
    left = sorted(p.name for p in target.iterdir())
    assert len(left) == 1 and (target / left[0]).is_dir(), left  # only what was not ours


def test_a_size_or_job_name_mistake_is_said_before_torch_is_imported(tmp_path: Path) -> None:
    """``--max-shard-size lots`` (or a job name that is none) imported torch first
    (the package's ``__init__``): ~1.5 s of CPU before a one-line answer."""
    code = ("import runpy, sys\n"
            "sys.argv = ['ckptd', 'export', *sys.argv[1:]]\n"
            "try:\n"
            "    runpy.run_module('ckptd', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print(exc.code, 'torch' in sys.modules)\n")
    store = tmp_path / "store"
    (store / "jobs").mkdir(parents=True)
    for job, more in ((JOB, ["--max-shard-size", "lots"]), ("no job", [])):
        done = subprocess.run([sys.executable, "-c", code, job, "--safetensors",
                               str(tmp_path / "x"), *more, "--url", f"file://{store}"],
                              capture_output=True, text=True, timeout=120)
        assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
        assert "is not a size" in done.stderr or "job name 'no job'" in done.stderr, done.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["--safetensors", "{tmp}/x", "--zarr", "{tmp}/y"], "one place at a time"),
    (["--safetensors", "{tmp}/x", "--max-shard-size", "lots"], "is not a size"),
    (["--safetensors", "{tmp}/x", "--max-shard-size", "0"], "more than 0 bytes"),
    (["--safetensors", "{tmp}/x", "--codec", "zstd"], "--codec is for --zarr"),
    (["--zarr", "{tmp}/x", "--only", "model."], "are for --safetensors"),
    (["--safetensors", "{tmp}/x", "--only", "nothing."], "holds no tensor starting with"),
    (["--safetensors", "{tmp}/x", "--strip", "model.", "--only", "model.f8",
      "--only", "f8"], "the same name"),
    (["--safetensors", "{tmp}/full"], "not an empty directory"),
    # (found by a probe: the names were exported unchanged, with no word)
    (["--safetensors", "{tmp}/x", "--strip", "modle."], "--strip 'modle.' matches no"),
    (["--safetensors", "{tmp}/x", "--only", "optim.", "--exclude", "optim."],
     "holds no tensor starting with 'optim.' and not with 'optim.'"),
    (["--zarr", "{tmp}/x", "--exclude", "model."], "are for --safetensors"),
])
def test_mistakes_get_one_line(tmp_path: Path, shm: Path, args: list[str], said: str) -> None:
    url = f"file://{tmp_path / 'store'}"
    full = save_two_ranks(url, shm)
    if "f8" in args:  # a tensor named "f8" beside "model.f8"
        with Checkpointer(url, "clash", shm_dir=shm) as c:
            c.save(1, {"model": {"f8": full["model.f8"]}, "f8": full["model.f8"]}).wait(60)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    job = "clash" if "f8" in args else JOB
    done = runner.invoke(app, ["export", job, "1", *[a.format(tmp=tmp_path) for a in args],
                               "--url", url])
    assert done.exit_code == 2, done.output
    assert said in " ".join(done.output.split()), done.output
    assert "Traceback" not in done.output and len(done.output.strip().splitlines()) <= 3
    assert not (tmp_path / "x").exists()
    assert (tmp_path / "full" / "keep").read_text() == "mine"


def test_a_dtype_safetensors_cannot_hold_is_refused_by_name(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "cx", shm_dir=shm) as c:
        c.save(1, {"w": torch.ones(3), "z": torch.ones(2, dtype=torch.complex128)}).wait(60)
    with pytest.raises(UnsupportedValue) as info:
        export_safetensors(url, "cx", tmp_path / "out")
    # (Found by a probe: it said "leave it out with --only", which only includes.)
    assert "'z'" in str(info.value) and "--exclude z" in str(info.value)
    export_safetensors(url, "cx", tmp_path / "out", exclude="z")  # left out, it exports
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == ["w"]
    done = runner.invoke(app, ["export", "cx", "--safetensors", str(tmp_path / "cli"),
                               "--exclude", "z", "--url", url])
    assert done.exit_code == 0, done.output
    assert sorted(load_file(tmp_path / "cli" / "model.safetensors")) == ["w"]


def test_import_refuses_a_damaged_file_and_a_bad_index_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    for source, said in ((bad, "not a readable safetensors file"),
                         (folder, "not a file name in")):
        done = runner.invoke(app, ["import", str(source), "--job", "j", "--step", "1",
                                   "--url", f"file://{tmp_path / 'store'}"])
        assert done.exit_code == 2, done.output
        assert said in " ".join(done.output.split())
        assert "Traceback" not in done.output
    with pytest.raises(InvalidRequest):
        import_checkpoint(folder, f"file://{tmp_path / 'store'}", "j", 1)


@pytest.mark.parametrize("case", ["not in the index", "mapped to another file"])
def test_import_refuses_files_that_hold_tensors_their_index_does_not_name(
        tmp_path: Path, case: str) -> None:
    """(Found by review.) The index is read to know which tensor is where; a tensor a
    file holds but the index does not put there was left out without a word."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    a, b = torch.arange(4.0), torch.arange(4.0, 8.0)
    if case == "not in the index":
        save_file({"a": a, "extra": b}, folder / "model-00001-of-00001.safetensors")
        weight_map = {"a": "model-00001-of-00001.safetensors"}
    else:  # one name in two files: the index says which, the other copy is dropped
        save_file({"a": a, "c": a.clone()}, folder / "model-00001-of-00002.safetensors")
        save_file({"a": b, "b": b.clone()}, folder / "model-00002-of-00002.safetensors")
        weight_map = {"a": "model-00002-of-00002.safetensors",
                      "b": "model-00002-of-00002.safetensors",
                      "c": "model-00001-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    done = runner.invoke(app, ["import", str(folder), "--job", "j", "--step", "1",
                               "--url", f"file://{tmp_path / 'store'}"])
    assert done.exit_code == 2, done.output
    said = " ".join(done.output.split())
    assert "does not put there" in said and "Traceback" not in said
    assert not (tmp_path / "store" / "jobs" / "j").exists()


def test_a_corrupt_cached_copy_is_passed_over_for_the_store(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    full = save_two_ranks(f"file://{store}", shm)
    cache = tmp_path / "cache"
    manifest = json.loads((store / f"jobs/{JOB}/steps/1/ranks/0.json").read_text())
    entry = next(e for e in manifest["entries"] if e["name"] == "model.big")
    for cid in entry["chunks"]:  # the cache holds model.big's chunks, the first one bad
        (cache / "chunks" / cid[:2]).mkdir(parents=True, exist_ok=True)
        data = bytearray((store / "chunks" / cid[:2] / cid).read_bytes())
        if cid == entry["chunks"][0]:
            data[0] ^= 0xFF
        (cache / "chunks" / cid[:2] / cid).write_bytes(bytes(data))
    monkeypatch.setenv("CKPTD_CACHE_DIR", str(cache))
    result = export_safetensors(f"file://{store}", JOB, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(same_bits(got[k], full[k]) for k in full)
    # model.big's bytes but its first chunk came from the cache; that one, and all
    # else, from the store.
    assert result.bytes_from["cache"] == entry["nbytes"] - CHUNK
    assert result.bytes_from["store"] == result.nbytes - result.bytes_from["cache"]


MEMORY = """
import json, sys
from ckptd.client.integrations.safetensors import export_safetensors
def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out
export_safetensors(sys.argv[1], sys.argv[2], sys.argv[3], max_shard_size="16MB")  # warm
before = status()
export_safetensors(sys.argv[1], sys.argv[2], sys.argv[4], max_shard_size="16MB")
print(json.dumps({"rise": status()["VmHWM"] - before["VmRSS"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "http"])
def test_memory_stays_below_one_file_whatever_the_step(where: str, tmp_path: Path, shm: Path,
                                                       server: Any) -> None:
    url = server.url if where == "http" else f"file://{tmp_path / 'store'}"
    g = torch.Generator().manual_seed(5)
    state = {"model": {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(16)}}
    with Checkpointer(url, "mem", shm_dir=shm, serve_peers=False) as ckpt:  # 64 MiB
        ckpt.save(1, state).wait(120)
    proc = subprocess.run([sys.executable, "-c", MEMORY, url, "mem", str(tmp_path / "a"),
                           str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rise = json.loads(proc.stdout)["rise"]
    files = sorted((tmp_path / "b").glob("*.safetensors"))
    assert len(files) == 6 and max(f.stat().st_size for f in files) <= 16 * 10**6  # 3 each
    assert rise <= 16 * 10**6, rise  # the largest file; the step is 64 MiB


TRANSFORMERS = """
import importlib.util, json, sys
sys.path[:] = sys.argv[3:]
assert importlib.util.find_spec("ckptd") is None, "ckptd must not be importable here"
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ref = load_file(sys.argv[2])
with torch.no_grad():
    logits = model(ref.pop("input_ids")).logits
state = model.state_dict()
print(json.dumps({
    "logits": bool(torch.equal(logits, ref.pop("logits"))),
    "params": sorted(k for k in ref if not torch.equal(state[k], ref[k])),
    "names": sorted(state) == sorted(ref),
}))
"""


@pytest.mark.slow
def test_transformers_loads_a_two_rank_export_of_a_llama(tmp_path: Path, shm: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    url = f"file://{tmp_path / 'store'}"
    # Two ranks, every matrix split by rows (FSDP's layout), with an optimizer beside.
    ckpts = [Checkpointer(url, "llama", rank=r, world_size=2, chunk_size=CHUNK, shm_dir=shm,
                          serve_peers=False) for r in range(2)]
    try:
        handles = []
        for r, c in enumerate(ckpts):
            model_part: dict[str, torch.Tensor] = {}
            shards: dict[str, Shard] = {}
            for k, v in weights.items():
                if v.dim() == 2:
                    half = v.shape[0] // 2
                    model_part[k] = v[r * half : (r + 1) * half if r == 0 else None].clone()
                    shards[f"model.{k}"] = Shard(tuple(v.shape), (r * half, 0))
                else:
                    model_part[k] = v
            optim = {"exp_avg": {k: torch.zeros(3) for k in list(weights)[:2]}}
            handles.append(c.save(1, {"model": model_part, "optim": optim}, shards=shards))
        assert "committed" in [h.wait(timeout=60).state for h in handles]
    finally:
        for c in ckpts:
            c.close()
    out = tmp_path / "release"
    done = runner.invoke(app, ["export", "llama", "--safetensors", str(out), "--only", "model.",
                               "--strip", "model.", "--max-shard-size", "40KB", "--url", url])
    assert done.exit_code == 0, done.output
    assert len(list(out.glob("*.safetensors"))) > 1
    config.save_pretrained(out)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    save_file({**weights, "input_ids": ids, "logits": logits}, tmp_path / "ref.safetensors")
    proc = subprocess.run([sys.executable, "-S", "-c", TRANSFORMERS, str(out),
                           str(tmp_path / "ref.safetensors"), *site_paths()],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"logits": True, "params": [], "names": True}


def _tiny_disk_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to mount a tiny tmpfs in a mount namespace of its own"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else "unshare --mount is refused here"


def test_a_full_disk_gets_one_line_and_leaves_nothing(tmp_path: Path, shm: Path) -> None:
    """An export into a filesystem without the room for it is refused before a byte
    is written, in one line (where, how much is free, how much it needs, what to
    do), exit 2, and nothing left there (a tmpfs of 16 KiB, in a mount namespace of
    the command's own)."""
    reason = _tiny_disk_unavailable()
    if reason is not None:
        pytest.skip(reason)
    url = f"file://{tmp_path / 'store'}"
    save_two_ranks(url, shm)
    disk = tmp_path / "disk"
    disk.mkdir()
    ckptd = Path(sys.executable).with_name("ckptd")
    script = (f'mount -t tmpfs -o size=16k tmpfs "{disk}" && '
              f'"{ckptd}" export {JOB} 1 --safetensors "{disk}/out" --url "{url}"; '
              f'rc=$?; echo "left: $(ls -A "{disk}")"; exit $rc')
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, said
    assert f"{disk}/out has 16.0 KiB free and the export needs" in said, said
    assert "free space there or export elsewhere" in said, said
    assert "Traceback" not in said and len(proc.stderr.strip().splitlines()) <= 3, said
    assert proc.stdout.split("left:")[-1].strip() == "", proc.stdout  # nothing on the disk


def test_a_write_that_fails_midway_gets_one_line_and_leaves_nothing(tmp_path: Path,
                                                                   shm: Path) -> None:
    """A write the filesystem refuses after the export began (here the file size
    limit, ``ulimit -f``, where a full disk or a quota would do the same): the file
    and the error in one line, exit 2, the partial file removed."""
    url = f"file://{tmp_path / 'store'}"
    save_two_ranks(url, shm)
    ckptd = Path(sys.executable).with_name("ckptd")
    target = tmp_path / "out"

    def limit() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, 32 * 1024))

    proc = subprocess.run([str(ckptd), "export", JOB, "1", "--safetensors", str(target),
                           "--url", url], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, said
    assert f"cannot write {target}/model.safetensors (" in said, said
    # (not "free space there": the limit is on one file, not the disk's room)
    assert "File too large; a file passed the size limit on one file (ulimit -f" in said, said
    assert "Traceback" not in said and len(proc.stderr.strip().splitlines()) <= 3, said
    assert not target.exists() or not any(target.iterdir()), list(target.iterdir())
