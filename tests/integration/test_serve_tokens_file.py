"""``ckptd serve --tokens-file`` given a directory says it is one and that a tokens
file is expected (it said the file was "not there yet", then a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_cli_mistakes import assert_short_usage_error, ckptd


@pytest.mark.parametrize("check", [True, False])
def test_a_tokens_file_that_is_a_directory_is_named_so(tmp_path: Path, check: bool) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir()
    done = ckptd("serve", "--store", str(tmp_path / "s"), "--port", "0", "--tokens-file",
                 str(folder), *(["--check"] if check else []))
    assert_short_usage_error(done, f"--tokens-file {folder}", "is a directory",
                             "tokens file", "ckptd token create")
    assert "not there yet" not in done.stdout + done.stderr
