"""A DCP ``Reader`` or ``Writer`` made with a user's mistake refuses it when it is
made, in the words a ``Checkpointer`` made with the same mistake uses (found by a
probe: each was built, and ``dcp.load`` / ``dcp.save`` then failed inside torch's
``CheckpointException``, with no hint, or with no URL)."""

from __future__ import annotations

import http.server
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.client import Checkpointer
from ckptd.client.dcp import Reader, Writer
from ckptd.errors import CkptdError, InvalidRequest, Unauthorized
from tests.conftest import ServerProcess
from tests.listeners import http_program

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # no process group


def refusal(make: Callable[[], Any]) -> CkptdError:
    with pytest.raises(CkptdError) as info:
        made = make()
        getattr(made, "close", lambda: None)()  # (one made after all)
    return info.value


@pytest.fixture
def saved(token_server: ServerProcess) -> ServerProcess:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, storage_writer=Writer(
            token_server.url, "d", 1, token=token_server.token))
    return token_server


@pytest.fixture
def plain_http() -> Iterator[str]:
    """A web server that is not ckptd (Python's http.server, answering 404)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    with http_program(Quiet) as url:
        yield url


@pytest.mark.parametrize("make", [
    lambda url: Reader(url, "d"),
    lambda url: Writer(url, "d", 2),
], ids=["Reader", "Writer"])
@pytest.mark.parametrize("url", ["{host_port}", ""], ids=["host:port", "empty"])
def test_a_url_a_checkpointer_refuses_is_refused_when_made(
        saved: ServerProcess, make: Callable[[str], Any], url: str) -> None:
    url = url.format(host_port=saved.url.removeprefix("http://"))
    error = refusal(lambda: make(url))
    assert isinstance(error, InvalidRequest)
    assert str(error) == str(refusal(lambda: Checkpointer(url, "d", token=saved.token)))
    if url:
        assert str(error) == f"url {url!r} has no scheme: did you mean http://{url}?"


@pytest.mark.parametrize("who", ["Reader", "Writer"])
def test_a_ckptd_url_without_its_scheme_is_refused_when_made(
        saved: ServerProcess, who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    host_port = saved.url.removeprefix("http://")
    monkeypatch.setenv("CKPTD_URL", host_port)
    error = refusal(lambda: Reader(job="d") if who == "Reader" else Writer(job="d", step=2))
    assert str(error) == f"CKPTD_URL {host_port!r} has no scheme: did you mean http://{host_port}?"


@pytest.mark.parametrize("token", ["ckptd_bogus", None], ids=["wrong", "none"])
def test_a_token_the_server_refuses_is_refused_when_the_reader_is_made(
        saved: ServerProcess, token: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    error = refusal(lambda: Reader(saved.url, "d", token=token))
    assert isinstance(error, Unauthorized)
    assert saved.url in str(error) and "as token= or CKPTD_TOKEN" in str(error)
    assert str(error) == str(refusal(lambda: Checkpointer(saved.url, "d", token=token)))
    # The reader of the right token still loads.
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=Reader(saved.url, "d", token=saved.token))
    assert torch.equal(target["w"], torch.ones(4))


def test_a_server_that_is_not_ckptd_is_refused_when_the_reader_is_made(
        plain_http: str) -> None:
    error = refusal(lambda: Reader(plain_http, "d"))
    assert isinstance(error, InvalidRequest)
    assert "does not answer as a ckptd server" in str(error)
    assert str(error) == str(refusal(lambda: Checkpointer(plain_http, "d")))


def test_a_token_the_server_refuses_a_writer_is_said_with_its_url(
        saved: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Writer asks nothing when it is made (one is made per save): the save says
    it, in the words a Checkpointer's refusal uses, not the server's bare
    "missing or wrong bearer token"."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptd.client.dcp import ckptd_error

    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.ones(4)}, storage_writer=Writer(saved.url, "d", 3,
                                                                 token="wrong"))
    error = ckptd_error(info.value)
    assert isinstance(error, Unauthorized), info.value
    assert saved.url in str(error) and "as token= or CKPTD_TOKEN" in str(error), error
