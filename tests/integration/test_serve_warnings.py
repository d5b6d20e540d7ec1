"""What ``ckptd serve`` warns of at start, said by ``serve --check`` too (found by
an operator's probe): ``CKPTD_TOKENS_FILES=tokens CKPTD_RETENTON=retention.toml
ckptd serve`` started an open server that kept every step without a word, and
``serve --check`` said only "ok: would serve"."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.cli_runs import ckptd
from tests.conftest import ServerProcess


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines()]


def test_a_misspelled_setting_is_said_with_the_one_meant(tmp_path: Path) -> None:
    env = {"CKPTD_TOKENS_FILES": "tokens", "CKPTD_RETENTON": "retention.toml",
           "CKPTD_NOTHING_LIKE_IT": "1"}
    done = ckptd("serve", "--check", "--store", str(tmp_path / "store"), "--port", "0", env=env)
    assert done.returncode == 0 and "ok: would serve" in done.stdout, done.stdout + done.stderr
    said = _lines(done.stderr)
    assert "warning CKPTD_TOKENS_FILES is not a ckptd setting (did you mean "\
        "CKPTD_TOKENS_FILE?)" in said, said
    assert "warning CKPTD_RETENTON is not a ckptd setting (did you mean "\
        "CKPTD_RETENTION?)" in said, said
    assert "warning CKPTD_NOTHING_LIKE_IT is not a ckptd setting" in said, said
    # Another command (a client's variable) says it too, and still runs.
    done = ckptd("token", "create", "--job", "j", "--role", "read", "--file",
                 str(tmp_path / "tokens"), env={"CKPTD_URLS": "http://127.0.0.1:1"})
    assert done.returncode == 0, done.stderr
    assert "warning CKPTD_URLS is not a ckptd setting (did you mean CKPTD_URL?)" \
        in _lines(done.stderr), done.stderr


def test_known_and_test_only_variables_are_no_warning(tmp_path: Path) -> None:
    env = {"CKPTD_GC_GRACE": "600", "CKPTD_CHUNK_SIZE": "65536", "CKPTD_URL": "x",
           "CKPTD_TEST_ANYTHING": "1", "CKPTD_IMAGE": "ckptd:0.1.0"}
    done = ckptd("serve", "--check", "--store", str(tmp_path / "store"), "--port", "0", env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_serving_server_says_it_in_its_log(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store", env={"CKPTD_RETENTON": "r.toml"})
    srv.start()
    srv.stop()
    assert "CKPTD_RETENTON is not a ckptd setting (did you mean CKPTD_RETENTION?)" \
        in " ".join(srv.log().split()), srv.log()


def test_serve_check_says_an_open_server_beyond_this_host(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    done = ckptd("serve", "--check", "--store", store, "--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 0 and "ok: would serve" in done.stdout, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "warning no token (CKPTD_TOKEN, --tokens-file) and listening on 0.0.0.0" in said, said
    done = ckptd("serve", "--check", "--store", store, "--host", "0.0.0.0", "--port", "0",
                 "--token", "s3cret-token")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_serve_check_says_every_warning_serve_logs_at_start(tmp_path: Path) -> None:
    """A replica whose own URL its --peers do not list, with no peer secret: what the
    server logs as it starts, ``serve --check`` of the same command says."""
    srv = ServerProcess(store=tmp_path / "store", extra_args=["--peers", "http://127.0.0.1:1"])
    srv.start()
    srv.stop()
    logged = [line.split(": ", 1)[1] for line in srv.log().splitlines()
              if " WARNING ckptd." in line]
    assert any("is not in --peers (http://127.0.0.1:1)" in w for w in logged), srv.log()
    assert any("CKPTD_PEER_SECRET is not set" in w for w in logged), srv.log()
    args = srv.command()[4:]  # (after ``python -m ckptd serve``)
    done = ckptd("serve", "--check", *args)
    assert done.returncode == 0 and "ok: would serve" in done.stdout, done.stdout + done.stderr
    said = _lines(done.stderr)
    for warning in logged:
        assert f"warning {' '.join(warning.split())}" in said, (warning, said)


def test_a_file_setting_set_but_empty_is_no_file(tmp_path: Path) -> None:
    """A template's unset value (``CKPTD_RETENTION=``) was the file '': ``serve``
    refused with "cannot read retention file : Is a directory" (found by review),
    and an empty certificate or key with "give both"."""
    for name in ("CKPTD_RETENTION", "CKPTD_TLS_CERT", "CKPTD_TLS_KEY"):
        done = ckptd("serve", "--check", "--store", str(tmp_path / "store"), "--port", "0",
                     env={name: ""})
        assert done.returncode == 0 and "ok: would serve" in done.stdout, (
            name, done.stdout + done.stderr)


def test_a_training_job_says_a_misspelled_variable_once_on_rank_0(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A ``Checkpointer`` read its knobs from the environment and said nothing of
    ``CKPTD_UPLOAD_CONCURENCY`` (found by review: only the commands warned)."""
    from ckptd.client import Checkpointer

    monkeypatch.setenv("CKPTD_UPLOAD_CONCURENCY", "4")
    url = f"file://{tmp_path / 'store'}"
    with caplog.at_level(logging.WARNING, logger="ckptd.client.config"):
        for rank in (0, 0, 1):
            Checkpointer(url, "j", rank=rank, world_size=2, shm_dir=str(shm),
                         serve_peers=False).close()
    said = [r.getMessage() for r in caplog.records if "CONCURENCY" in r.getMessage()]
    assert said == ["CKPTD_UPLOAD_CONCURENCY is not a ckptd setting (did you mean "
                    "CKPTD_UPLOAD_CONCURRENCY?)"], caplog.text
