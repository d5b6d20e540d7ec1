"""What ``ckptd serve`` warns of at start, said by ``serve --check`` too (found by
an operator's probe): ``CKPTD_TOKENS_FILES=tokens CKPTD_RETENTON=retention.toml
ckptd serve`` started an open server that kept every step without a word, and
``serve --check`` said only "ok: would serve"."""

from __future__ import annotations

from pathlib import Path

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
