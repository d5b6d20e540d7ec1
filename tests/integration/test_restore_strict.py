"""A restore checks the target's keys against the checkpoint before it writes:
an entry the checkpoint lacks, or one a module has no place for, is a typed
``RestoreError`` with the target unchanged (``strict``, as torch's
``load_state_dict``); ``strict=False`` leaves the first and skips the second."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import RestoreError

pytestmark = pytest.mark.timeout(120)


class WithExtra(torch.nn.Module):
    """A Linear(4, 3) with one more parameter than the checkpoint has."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((3, 4), 7.0))
        self.bias = torch.nn.Parameter(torch.full((3,), 7.0))
        self.extra = torch.nn.Parameter(torch.full((5,), 7.0))


@pytest.fixture
def saved(tmp_path: Path, shm: Path) -> tuple[str, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "strict", shm_dir=shm) as ckpt:
        ckpt.save(1, {"model": model, "epoch": 3}).wait(60)
    return url, model


def test_an_entry_the_checkpoint_lacks_is_refused_before_anything_changes(
    saved: tuple[str, torch.nn.Linear], shm: Path
) -> None:
    url, _ = saved
    target = WithExtra()
    with Checkpointer(url, "strict", shm_dir=shm) as ckpt:
        with pytest.raises(RestoreError) as err:
            ckpt.restore({"model": target})
        assert "state['model']['extra']" in err.value.detail["entries"]
        assert "strict=False" in str(err.value)
        assert torch.equal(target.weight, torch.full((3, 4), 7.0))  # unchanged
        with pytest.raises(RestoreError) as err:  # a plain key, too
            ckpt.restore({"model": torch.nn.Linear(4, 3), "lr": 0.1})
        assert err.value.detail["entries"] == ["state['lr']"]


def test_an_entry_a_module_has_no_place_for_is_refused_before_anything_changes(
    saved: tuple[str, torch.nn.Linear], shm: Path
) -> None:
    url, _ = saved
    target = torch.nn.Linear(4, 3, bias=False)
    torch.nn.init.constant_(target.weight, 5.0)
    with Checkpointer(url, "strict", shm_dir=shm) as ckpt:
        with pytest.raises(RestoreError) as err:
            ckpt.restore({"model": target, "epoch": 0})
        assert err.value.detail["entries"] == ["state['model']['bias']"]
        assert torch.equal(target.weight, torch.full((3, 4), 5.0))  # unchanged


def test_strict_false_leaves_and_skips(
    saved: tuple[str, torch.nn.Linear], shm: Path
) -> None:
    url, model = saved
    extra, no_bias = WithExtra(), torch.nn.Linear(4, 3, bias=False)
    with Checkpointer(url, "strict", shm_dir=shm) as ckpt:
        result = ckpt.restore({"model": extra, "lr": 0.1}, strict=False)
        assert result.step == 1
        assert torch.equal(extra.weight, model.weight)
        assert torch.equal(extra.extra, torch.full((5,), 7.0))
        ckpt.restore({"model": no_bias}, strict=False)
        assert torch.equal(no_bias.weight, model.weight)


@pytest.mark.parametrize("strict", [True, False])
def test_a_tensor_where_the_checkpoint_holds_a_dict_is_refused(
    saved: tuple[str, torch.nn.Linear], shm: Path, strict: bool
) -> None:
    """(Found by a probe.) A target's tensor is filled in place; where the checkpoint
    holds a state dict instead, the restore put the dict in its place and left the
    caller's tensor as it was, reporting success."""
    url, _ = saved
    mine = torch.full((3,), 7.0)
    target = {"model": mine, "epoch": 0}
    with Checkpointer(url, "strict", shm_dir=shm) as ckpt, pytest.raises(RestoreError) as err:
        ckpt.restore(target, strict=strict)
    assert "state['model']: the target holds a tensor there, the checkpoint a dict" in str(
        err.value), err.value
    assert target["model"] is mine and target["epoch"] == 0


def test_a_plain_dict_takes_the_entries_it_does_not_hold(
    saved: tuple[str, torch.nn.Linear], shm: Path
) -> None:
    """(docs/client.md) Only a module has places to check against: a plain dict
    gains the checkpoint's other entries, strict or not."""
    url, model = saved
    target: dict[str, object] = {"model": torch.nn.Linear(4, 3)}
    with Checkpointer(url, "strict", shm_dir=shm) as ckpt:
        ckpt.restore(target)
    assert target["epoch"] == 3 and sorted(target) == ["epoch", "model"]
    assert torch.equal(target["model"].weight, model.weight)  # type: ignore[attr-defined]
