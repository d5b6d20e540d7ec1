"""Off a terminal (a pipe, a log file, ``kubectl logs``) the CLI writes plain lines:
nothing wrapped at 80 columns, no path or URL split across lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ckptd.client import Checkpointer


def test_a_long_path_stays_on_its_line_when_output_is_piped(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, job="plain", chunk_size=64 * 1024, serve_peers=False,
                      shm_dir=tmp_path / "shm") as ckpt:
        ckpt.save(4, {"w": torch.arange(1000.0)}).wait(timeout=60)
    target = tmp_path / ("a-node-cache-directory-whose-name-is-long-enough-to-pass-80-columns")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "restore", "--job", "plain", "--rank", "0",
         "--to", str(target), "--url", url, "--no-peers"],
        capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("ok")]
    assert f"into {target} (" in line, done.stdout
    assert len(line) > 80
    # Its rows too: a table is as wide as its rows, not the 80 columns of no terminal.
    bad = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--url", f"file://{target}x"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert f"{target}x" in bad.stdout + bad.stderr


def test_verify_and_export_answer_on_their_first_line_when_piped(tmp_path: Path) -> None:
    """(found by a probe: rich ends a progress bar off a terminal with a blank line,
    and that was the first line of their output)"""
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, job="plain", serve_peers=False, shm_dir=tmp_path / "shm") as ckpt:
        ckpt.save(4, {"w": torch.arange(1000.0)}).wait(timeout=60)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    for args, first in [
        (["verify", "plain"], "checked 1 chunks"),
        (["export", "plain", "--safetensors", str(tmp_path / "st")], "ok: step 4 of plain"),
        (["export", "plain", "--zarr", str(tmp_path / "z")], "ok: step 4 of plain"),
    ]:
        done = subprocess.run([sys.executable, "-m", "ckptd", *args, "--url", url],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.splitlines()[0].startswith(first), (args, done.stdout)
