"""``ckptd_error`` finds the typed error of a ``dcp.load`` whose metadata read
failed, which DCP replaces with ``AssertionError("metadata is None; ...")``."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.client.dcp import Reader, Writer, ckptd_error
from ckptd.errors import CheckpointNotFound, CkptdError, Unavailable
from tests.conftest import ServerProcess, free_port

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # no process group


def load_error(reader: Reader) -> CkptdError | None:
    with warnings.catch_warnings(), pytest.raises(BaseException) as info:
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader)
    return ckptd_error(info.value)


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"file://{tmp_path / 'store'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, storage_writer=Writer(url, job="d", step=1))
    return url


@pytest.mark.parametrize("how", ["step=", "checkpoint_id="])
def test_a_step_that_does_not_exist_is_refused_before_torch_logs_a_fallback(
        url: str, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """(Found by a probe.) Raised from read_metadata, it made torch log "Global
    metadata is not found. Falling back to rank local metadata." with a traceback
    on stderr (twice, with "Rank local metadata is not found."), then raise its own
    error: an explicit step is checked when the Reader is made (or reset)."""
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointNotFound) as info, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "step=":
            dcp.load({"w": torch.zeros(4)}, storage_reader=Reader(url, job="d", step=99))
        else:
            dcp.load({"w": torch.zeros(4)}, storage_reader=Reader(url, job="d"),
                     checkpoint_id=f"{url}/d/99")
    assert info.value.detail["step"] == 99
    assert not [r.getMessage() for r in caplog.records if "metadata" in r.getMessage()]


@pytest.mark.parametrize("where", ["server", "file"])
@pytest.mark.parametrize("how", ["Reader(url, job)", "checkpoint_id=.../latest"])
def test_a_job_with_no_committed_step_is_refused_before_torch_logs_a_fallback(
        server: ServerProcess, url: str, where: str, how: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """(Found by a probe.) The latest of a job with no committed step failed inside
    read_metadata: torch logged its 88-line fallback traceback, then raised
    ``AssertionError: metadata is None``. It is the usual first run's mistake: one
    CheckpointNotFound that says what to do, as for a named step."""
    if where == "server":
        url = server.url
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.ones(4)}, storage_writer=Writer(url, job="d", step=1))
    target = {"a": torch.zeros(3)}
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointNotFound) as info, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "Reader(url, job)":
            dcp.load(target, storage_reader=Reader(url, "nojob"))
        else:
            dcp.load(target, storage_reader=Reader(url, "d"),
                     checkpoint_id=f"{url}/nojob/latest")
    message = str(info.value)
    assert message.startswith("job nojob has no committed checkpoint")
    assert "from scratch" in message and "\n" not in message
    assert info.value.detail["job"] == "nojob"
    assert not [r.getMessage() for r in caplog.records if "metadata" in r.getMessage()]
    assert torch.equal(target["a"], torch.zeros(3))
    # A job that has one loads its latest through the same check.
    loaded = {"w": torch.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=Reader(url, "d"))
    assert torch.equal(loaded["w"], torch.ones(4))


def test_a_server_that_cannot_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "0")
    err = load_error(Reader(f"http://127.0.0.1:{free_port()}", job="d", timeout=10))
    assert isinstance(err, Unavailable)


def test_a_later_failure_is_not_blamed_on_an_earlier_metadata_error(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "0")
    # (no server there: read_metadata fails, the reader itself is made)
    reader = Reader(f"http://127.0.0.1:{free_port()}", job="d", timeout=10)
    assert isinstance(load_error(reader), Unavailable)
    reader.reset(f"{url}/d/1")  # metadata reads now; the load fails on its shape
    with warnings.catch_warnings(), pytest.raises(BaseException) as info:
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(5)}, storage_reader=reader)
    assert not isinstance(ckptd_error(info.value), Unavailable)
