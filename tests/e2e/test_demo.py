"""The README's demo, end to end: torchrun, a real server, a SIGKILLed rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_recovers_a_killed_rank_bitwise(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "demo", "--workdir", str(tmp_path), "--steps", "24"],
        capture_output=True, text=True, timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "died at step" in out
    assert "restarted and restored step" in out
    assert "OK:" in out and "bitwise" in out
