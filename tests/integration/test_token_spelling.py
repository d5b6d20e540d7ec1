"""A token with whitespace around it (a Kubernetes secret mounted as a file ends in a
newline) is the token; one with a character no token has inside is one line that
does not repeat it. Before: "Illegal header value b'Bearer <the whole token>\\n'",
retried five times as a network failure, with "start it (ckptd serve)" from a new
Checkpointer after 20 s; a non-ASCII one was a UnicodeEncodeError's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import InvalidRequest
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess

TOKEN = "s3cret-token"  # (tests/conftest.py's token_server)


def _ls(url: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_TOKEN"] = token
    return run_ckptd("ls", "--url", url, environ=env)


@pytest.mark.parametrize("spelt", [TOKEN + "\n", TOKEN + "\r\n", f"  {TOKEN} "])
def test_whitespace_around_a_token_is_not_the_token(token_server: ServerProcess,
                                                    spelt: str, tmp_path: Path) -> None:
    done = _ls(token_server.url, spelt)
    assert done.returncode == 0, done.stderr
    with Checkpointer(token_server.url, "spelt", token=spelt, shm_dir=tmp_path / "shm",
                      serve_peers=False) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(4)}).wait(60).state == "committed"


@pytest.mark.parametrize("spelt", ["s3cret token", "s3cret\ntoken", "s3crét-token"])
def test_a_character_no_token_has_is_one_line_without_the_token(
        token_server: ServerProcess, spelt: str) -> None:
    done = _ls(token_server.url, spelt)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "character no token has" in done.stderr and "CKPTD_TOKEN" in done.stderr
    assert "s3cr" not in done.stderr, done.stderr  # (never the token, nor a part of it)
    assert len(done.stderr.strip().splitlines()) <= 3, done.stderr
    with pytest.raises(InvalidRequest, match="character no token has"):
        Checkpointer(token_server.url, "spelt", token=spelt, serve_peers=False)


def test_a_server_token_with_a_newline_is_the_token(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store", token=TOKEN + "\n")
    srv.start()
    try:
        assert _ls(srv.url, TOKEN).returncode == 0
    finally:
        srv.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_TOKEN"] = "s3cret token"
    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--store",
                           str(tmp_path / "store"), "--check"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "CKPTD_TOKEN" in done.stderr, done.stderr
    assert "s3cret" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_peer_secret_is_a_key_not_a_header() -> None:
    """The peer secret is never sent: a passphrase with spaces is one (9eb0c83 refused
    it as it refuses a token), only the whitespace around it goes."""
    from ckptd.server.settings import Settings

    assert Settings(peer_secret="  a long pass phrase\n").peer_secret == "a long pass phrase"
    with pytest.raises(ValueError, match="no token sent in a header"):
        Settings(token="a long pass phrase")
