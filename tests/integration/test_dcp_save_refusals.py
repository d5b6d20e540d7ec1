"""A DCP save of a value ckptd cannot store is refused as a ``Checkpointer`` save
of it is: one line naming the value and its type, before any byte is sent."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptd.client import Checkpointer
from ckptd.client.dcp import Writer, ckptd_error
from ckptd.errors import UnsupportedValue
from tests.conftest import ServerProcess

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # no process group


class Opaque:
    """An object of the user's own: torch pickles it; ckptd cannot store it."""


@pytest.mark.parametrize("value", [object(), Opaque(), [1, Opaque()]],
                         ids=["object", "own class", "inside a list"])
def test_an_object_is_refused_as_a_checkpointer_refuses_it(
        server: ServerProcess, shm: Path, value: Any) -> None:
    """(Found by a probe.) The writer's weights_only check gave torch's load-time
    message, about a "file" and how to load it anyway, with its terminal escape
    codes (\\x1b[1m), during a save."""
    state = {"a": torch.ones(2), "o": value}
    with pytest.raises(CheckpointException) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=Writer(server.url, "dcp4", 1))
    err = ckptd_error(info.value)
    assert isinstance(err, UnsupportedValue), info.value
    with Checkpointer(server.url, job="ck", shm_dir=shm, on_error="raise") as ckpt, \
            pytest.raises(UnsupportedValue) as said:
        ckpt.save(1, state)
    assert str(err) == str(said.value)
    assert "cannot store without pickling" in str(err) and "\n" not in str(err)
    assert "\x1b" not in str(err) and "file" not in str(err)
    with Checkpointer(server.url, job="dcp4", shm_dir=shm) as ckpt:
        assert ckpt.latest() is None  # nothing was committed


def test_a_bare_step_id_without_a_job_says_to_pass_the_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by a probe: with CKPTD_URL set, "Writer has no job: pass url= and job=
    (or set CKPTD_URL)", as if the variable were the fix.) No server is reached."""
    from ckptd.client.dcp import Reader
    from ckptd.errors import InvalidRequest

    monkeypatch.setenv("CKPTD_URL", "http://127.0.0.1:9")
    for storage in ({"storage_writer": Writer()}, {"storage_reader": Reader()}):
        with pytest.raises(CheckpointException) as info, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "storage_writer" in storage:
                dcp.save({"a": torch.ones(2)}, checkpoint_id="3", **storage)
            else:
                dcp.load({"a": torch.ones(2)}, checkpoint_id="3", **storage)
        err = ckptd_error(info.value)
        assert isinstance(err, InvalidRequest), info.value
        assert "has no job: pass job=" in str(err) and "CKPTD_URL" not in str(err), err
