"""A zarr view of a job, step or server it cannot read says which, in ckptd's words
(those of the CLI and the checkpointer), not zarr's "No group found in store"."""

from __future__ import annotations

import pytest
import torch
import zarr

from ckptd.client import Checkpointer
from ckptd.errors import CheckpointNotFound, JobNotFound, Unauthorized
from ckptd.zarr import CheckpointStore
from tests.conftest import ServerProcess
from tests.zarr.conftest import JOB


def test_a_job_or_step_not_there_is_said_as_the_cli_says_it(file_step: str) -> None:
    with pytest.raises(JobNotFound) as no_job:
        zarr.open_group(store=CheckpointStore(file_step, "nojob", step=1200), mode="r")
    assert str(no_job.value) == f"no job 'nojob' at {file_step}; jobs there: {JOB}"
    with pytest.raises(JobNotFound):  # (the latest step of a job not there)
        zarr.open_group(store=CheckpointStore(file_step, "nojob"), mode="r")
    with pytest.raises(CheckpointNotFound) as no_step:
        zarr.open_group(store=CheckpointStore(file_step, JOB, step=1300), mode="r")
    assert str(no_step.value) == f"no checkpoint at step 1300 of {JOB}"
    # The view opens once the mistake is mended (a failed open leaves it unopened).
    root = zarr.open_group(store=CheckpointStore(file_step, JOB, step=1), mode="r")
    assert root.attrs["epoch"] == 3


def test_a_server_refusing_the_token_is_named_with_how_to_pass_one(
    token_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    url = token_server.url
    with Checkpointer(url, JOB, rank=0, world_size=1, token=token_server.token) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(3)}).wait(timeout=60).state == "committed"
    for token, what in ((None, "needs a token and none was given"),
                        ("wrong", "refused the token given")):
        store = CheckpointStore(url, JOB, step=1, token=token)
        with pytest.raises(Unauthorized) as refused:
            zarr.open_group(store=store, mode="r")
        said = str(refused.value)
        assert said.startswith(f"the ckptd server at {url} {what}"), said
        assert "as token= or CKPTD_TOKEN" in said
        store.close()
    store = CheckpointStore(url, "nojob", step=1, token=token_server.token)
    with pytest.raises(JobNotFound, match=f"^no job 'nojob' at {url}; jobs there: {JOB}$"):
        zarr.open_group(store=store, mode="r")
    store.close()
