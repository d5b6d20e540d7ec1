"""``step="latest"``, the CLI's word, is refused by the Python API with what to pass
instead (``step=None``): one line, never accepted as a step."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.client import Checkpointer
from ckptd.client.dcp import Reader
from ckptd.client.integrations.safetensors import export_safetensors
from ckptd.errors import InvalidName
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)


def test_step_latest_says_to_pass_none(server: ServerProcess, shm: Path,
                                       tmp_path: Path) -> None:
    """(Found by a probe.) The message said only that the step must be an integer."""
    with Checkpointer(server.url, job="j", shm_dir=shm, on_error="raise") as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait()
        ckpt.save(2, {"w": torch.full((3,), 2.0)}).wait()
        target: dict[str, Any] = {"w": torch.zeros(3)}
        refusals = []
        for call in (
            lambda: ckpt.restore(target, step="latest"),
            lambda: ckpt.restore(target, step=" Latest "),
            lambda: Reader(server.url, "j", step="latest"),
            lambda: export_safetensors(server.url, "j", tmp_path / "out", step="latest"),
        ):
            with pytest.raises(InvalidName) as info:
                call()
            refusals.append(str(info.value))
        assert torch.equal(target["w"], torch.zeros(3))  # nothing was restored
        for said in refusals:
            assert "must be an integer" in said and "pass step=None" in said, said
            assert "\n" not in said
        # step=None is the latest, as said.
        assert ckpt.restore(target, step=None).step == 2
    assert torch.equal(target["w"], torch.full((3,), 2.0))
    loaded = {"w": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=Reader(server.url, "j", step=None))
    assert torch.equal(loaded["w"], torch.full((3,), 2.0))
    # A step that is digits in a str is refused too, saying what to do with it.
    with pytest.raises(InvalidName, match=r"pass int\(step\)"):
        Reader(server.url, "j", step="2")
