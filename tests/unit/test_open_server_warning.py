"""A server that listens beyond loopback without a token says so as it starts
(found by a multi-node probe: the documented replica command, ``--host 0.0.0.0``
and no token, let any host roll a job back, without a word in the log)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ckptd.server.app import create_app
from ckptd.server.settings import Settings


@pytest.mark.parametrize(("host", "token", "said"), [
    ("0.0.0.0", None, True),
    ("::", None, True),
    ("ckptd-a", None, True),
    ("0.0.0.0", "a-token", False),
    ("127.0.0.1", None, False),
    ("::1", None, False),
    ("localhost", None, False),
])
def test_an_open_server_without_a_token_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                              host: str, token: str | None, said: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="ckptd.server.app"):
        create_app(Settings(store=str(tmp_path / "store"), host=host, token=token))
    warned = [r.getMessage() for r in caplog.records if "no token" in r.getMessage()]
    assert bool(warned) == said, warned
    if said:
        assert host in warned[0] and "docs/SECURITY.md" in warned[0], warned
