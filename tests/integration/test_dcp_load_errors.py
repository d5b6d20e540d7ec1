"""``ckptd_error`` finds the typed error of a ``dcp.load`` whose metadata read
failed, which DCP replaces with ``AssertionError("metadata is None; ...")``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.client.dcp import Reader, Writer, ckptd_error
from ckptd.errors import CheckpointNotFound, CkptdError, Unavailable
from tests.conftest import free_port

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


def test_a_step_that_does_not_exist(url: str) -> None:
    err = load_error(Reader(url, job="d", step=99))
    assert isinstance(err, CheckpointNotFound)
    assert err.detail["step"] == 99


def test_a_job_that_does_not_exist(url: str) -> None:
    assert isinstance(load_error(Reader(url, job="nosuch")), CheckpointNotFound)


def test_a_server_that_cannot_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "0")
    err = load_error(Reader(f"http://127.0.0.1:{free_port()}", job="d", timeout=10))
    assert isinstance(err, Unavailable)


def test_a_later_failure_is_not_blamed_on_an_earlier_metadata_error(url: str) -> None:
    reader = Reader(url, job="d", step=99)
    assert isinstance(load_error(reader), CheckpointNotFound)
    reader.reset(f"{url}/d/1")  # metadata reads now; the load fails on its shape
    with warnings.catch_warnings(), pytest.raises(BaseException) as info:
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(5)}, storage_reader=reader)
    assert not isinstance(ckptd_error(info.value), CheckpointNotFound)
