"""Mistakes a reviewer made on the command line (review r1): each is one or two lines
that say what to do, exit code 2, never a traceback; both transports (a server and a
file:// store) answer a bad lifecycle option alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_cli_mistakes import _save_one, assert_short_usage_error, ckptd


@pytest.fixture
def saved_store(tmp_path: Path, shm: Path) -> str:
    """A file:// store holding step 1 of job llm-7b."""
    url = f"file://{tmp_path / 'files'}"
    _save_one(url, "llm-7b", shm)
    return url


# -- 1. tracebacks ------------------------------------------------------------------------


def test_export_into_a_directory_that_cannot_be_made(saved_store: str, tmp_path: Path) -> None:
    done = ckptd("export", "llm-7b", "1", "--zarr", "/proc/x.zarr", "--url", saved_store)
    assert_short_usage_error(done, "/proc/x.zarr", "directory you can write")


def test_import_of_files_that_are_no_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "mk.py"
    script.write_text("import torch\nprint(torch.ones(2))\n")
    url = f"file://{tmp_path / 'store'}"
    for source in ("/proc/self/status", str(script)):
        done = ckptd("import", source, "--job", "imp", "--step", "9", "--url", url)
        assert_short_usage_error(done, source, "neither a zarr v3 hierarchy")


@pytest.mark.parametrize("args,needles", [
    (["--retention", "/nonexist.toml"], ["/nonexist.toml"]),
    (["--peers", "garbage"], ["--peers", "garbage", "http://"]),
])
def test_serve_checks_its_files_and_peers_before_it_starts(
    args: list[str], needles: list[str], tmp_path: Path
) -> None:
    done = ckptd("serve", "--store", str(tmp_path / "s"), "--port", "0", *args)
    assert_short_usage_error(done, *needles)
