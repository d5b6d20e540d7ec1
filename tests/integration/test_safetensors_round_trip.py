"""A step exported as safetensors and imported again is the step it was (found by a
fresh-user probe): the import made every name a top-level key
(``{"model": {...}}`` came back as ``{"model.0.weight": ...}``), so
``restore({"model": m})`` failed with "lacks 1 entries the target holds:
state['model']"; and a file's own ``__metadata__`` was dropped without a word.

Now an export records each tensor's place in the saved state in its files'
``__metadata__`` (``ckptd.paths``), the import puts the tensors back there, and a
source file's other ``__metadata__`` is kept in the step's manifest, written back
by the next export. Through a real ``ckptd serve``, by the command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer
from ckptd.client.step_import import import_checkpoint
from ckptd.errors import RestoreError

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3).to(torch.bfloat16))


def _cli(*args: str) -> str:
    done = runner.invoke(app, list(args))
    assert done.exit_code == 0, done.output
    return done.output


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_an_imported_export_restores_into_the_structure_it_came_from(
        tmp_path: Path, shm: Path, server: Any) -> None:
    model = _model(1)
    bufs = [torch.arange(5, dtype=torch.int64), torch.ones(2, 2)]
    with Checkpointer(server.url, "src", shm_dir=shm) as ckpt:
        ckpt.save(1, {"model": model, "bufs": bufs, "epoch": 3}).wait(60)
    # Several files: the import must put each file's tensors back at their places.
    _cli("export", "src", "1", "--safetensors", str(tmp_path / "a"), "--max-shard-size", "300",
         "--url", server.url)
    assert len(list((tmp_path / "a").glob("*.safetensors"))) > 1
    _cli("import", str(tmp_path / "a"), "--job", "back", "--step", "7", "--url", server.url)

    fresh = _model(2)
    with Checkpointer(server.url, "back", shm_dir=shm) as ckpt:
        assert ckpt.restore({"model": fresh}).step == 7  # strict: every entry found
        plain: dict[str, Any] = {}
        ckpt.restore(plain)
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values(),
                                 strict=True):
        assert got.dtype == want.dtype and _bits(got) == _bits(want), name
    assert sorted(plain) == ["bufs", "model"]  # (the epoch, a value, is in no file)
    assert isinstance(plain["bufs"], list) and len(plain["bufs"]) == 2
    assert all(_bits(g) == _bits(w) for g, w in zip(plain["bufs"], bufs, strict=True))

    # The imported step exports to the same files: same split, same tensors, same
    # places (the order the state had is recorded too).
    _cli("export", "back", "7", "--safetensors", str(tmp_path / "b"), "--max-shard-size", "300",
         "--url", server.url)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        if name.endswith(".json"):
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
            continue
        first, second = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert first.keys() == second.keys()
        assert all(_bits(first[k]) == _bits(second[k]) for k in first)
        with safe_open(tmp_path / "a" / name, "pt") as f1, \
                safe_open(tmp_path / "b" / name, "pt") as f2:
            assert f1.metadata()["ckptd.paths"] == f2.metadata()["ckptd.paths"]


def test_a_files_own_metadata_goes_through_an_import_and_back_out(
        tmp_path: Path, shm: Path, server: Any) -> None:
    source = tmp_path / "custom.safetensors"
    w = torch.randn(4, 4)
    save_file({"w": w}, source, metadata={"custom": "keepme", "format": "pt"})
    _cli("import", str(source), "--job", "meta", "--step", "1", "--url", server.url)
    _cli("export", "meta", "1", "--safetensors", str(tmp_path / "out"), "--url", server.url)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        meta = f.metadata()
        assert _bits(f.get_tensor("w")) == _bits(w)
    assert meta == {"custom": "keepme", "format": "pt", "ckptd.job": "meta", "ckptd.step": "1"}


def test_places_that_are_no_state_import_by_name_saying_why(
        tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Files edited after the export (or written by another tool) whose
    ``ckptd.paths`` put two tensors at one place: the tensors import under their
    names, and the log says why."""
    url = f"file://{tmp_path / 'store'}"
    source = tmp_path / "edited.safetensors"
    places = json.dumps({"a": ["x", "y"], "b": ["x", "y"]})
    save_file({"a": torch.ones(2), "b": torch.zeros(2)}, source,
              metadata={"format": "pt", "ckptd.paths": places})
    with caplog.at_level(logging.WARNING, logger="ckptd.client.step_import"):
        import_checkpoint(source, url, "edited", 1, shm_dir=shm)
    assert "'b' is placed where another tensor is" in caplog.text, caplog.text
    with Checkpointer(url, "edited", shm_dir=shm) as ckpt:
        got: dict[str, Any] = {}
        ckpt.restore(got)
    assert sorted(got) == ["a", "b"]


@pytest.mark.parametrize(("places", "why"), [
    ({"a": ["x"], "b": ["x", "y"]}, "'b' is placed inside another tensor"),
    ({"a": ["l", [0]], "b": ["l", [2]]}, "a list's items are not all there"),
    ({"a": ["l", [0]], "b": ["l", "k"]}, "mixes a list and a mapping"),
    ({"a": [[0]]}, "mixes a list and a mapping"),
    ({"a": ["x", True]}, "which is no key"),
    ({"a": []}, "is not a list of keys"),
])
def test_places_that_are_no_state_are_refused_by_the_layout(places: dict[str, Any],
                                                            why: str) -> None:
    from ckptd.client.integrations.safetensors.layout import nested_state

    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        nested_state({name: torch.ones(1) for name in places}, places)
    # Places that are a state: int keys stay ints, list items a list in index order.
    state = nested_state({"a": 1, "b": 2, "c": 3},
                         {"a": ["o", 0, "m"], "b": ["l", [1]], "c": ["l", [0]]})
    assert state == {"o": {0: {"m": 1}}, "l": [3, 2]}


def test_flat_files_restored_into_a_tree_say_how_to_restore_them(tmp_path: Path,
                                                                 shm: Path) -> None:
    """(Found by a probe: "lacks 1 entries the target holds: state['model']", with
    no word that the step holds flat names.)"""
    model = torch.nn.Linear(3, 2)
    source = tmp_path / "model.safetensors"
    save_file({f"model.{k}": v for k, v in model.state_dict().items()}, source)
    url = f"file://{tmp_path / 'store'}"
    import_checkpoint(source, url, "flat", 1, shm_dir=shm)
    with Checkpointer(url, "flat", shm_dir=shm) as ckpt, \
            pytest.raises(RestoreError) as info:
        ckpt.restore({"model": torch.nn.Linear(3, 2)})
    said = info.value.message
    assert "lacks 1 entry the target holds" in said, said
    assert "flat names such as 'model.bias'" in said and "state_dict()" in said, said


def test_a_step_nested_otherwise_than_the_target_says_the_restore_that_fits(
        tmp_path: Path, shm: Path) -> None:
    """(Found by a probe: a flat Hugging Face file of a module's own names, restored
    as {"model": model}, said only "lacks 1 entry the target holds: state['model']".)"""
    model = torch.nn.Linear(3, 2)
    source = tmp_path / "model.safetensors"
    save_file(model.state_dict(), source)  # 'weight', 'bias': no prefix to see
    url = f"file://{tmp_path / 'store'}"
    import_checkpoint(source, url, "flat", 1, shm_dir=shm)
    with Checkpointer(url, "flat", shm_dir=shm) as ckpt:
        for target, how in (
                ({"model": torch.nn.Linear(3, 2)},
                 "restore(model.state_dict()) of the module at state['model']"),
                ({"model": torch.nn.Linear(3, 2).state_dict()}, "restore(state['model'])")):
            with pytest.raises(RestoreError) as info:
                ckpt.restore(target)
            said = info.value.message
            assert said.startswith("the checkpoint of step 1 lacks 1 entry the target holds: "
                                   "state['model']; "), said
            assert said.endswith(". The step holds the names of state['model'] at its top "
                                 f"(such as 'weight': a flat import): {how} restores them"), said
            assert "\n" not in said
        again = torch.nn.Linear(3, 2)
        ckpt.restore(again.state_dict())  # the way the line gives
        assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)
        # The other way round: a module saved under "model", its state_dict() given.
        ckpt.save(2, {"model": model}).wait(60)
        with pytest.raises(RestoreError) as info:
            ckpt.restore(torch.nn.Linear(3, 2).state_dict(), step=2)
        said = info.value.message
        assert said.endswith(". The step holds them one level down, under 'model' (such as "
                             "state['model']['weight']): restore({'model': model}) (or a dict "
                             "nested so) restores them"), said
        # A target that is neither: no word of nesting.
        with pytest.raises(RestoreError) as info:
            ckpt.restore({"other": torch.ones(2)}, step=2)
        assert info.value.message.endswith("strict=False) leaves them as they are"), \
            info.value.message
