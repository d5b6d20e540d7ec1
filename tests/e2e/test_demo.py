"""The README's demo, end to end: torchrun, a real server, a SIGKILLed rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_recovers_a_killed_rank_bitwise(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "demo", "--workdir", str(tmp_path), "--steps", "24"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the demo, its server, torchrun and workers
        output, _ = proc.communicate()
        pytest.fail(f"the demo ran past 240 s:\n{output.decode(errors='replace')[-6000:]}")
    out = output.decode(errors="replace")
    assert proc.returncode == 0, out
    # A line per phase while it trains, not a minute of silence: rank 0's saves
    # are reported during each run, before its "done in".
    reference = out.split("2. faulty run", 1)[0]
    assert "step 5/24 trained, checkpoint saved" in reference, out
    assert reference.index("step 5/24 trained") < reference.index("done in"), out
    assert "killed at step" in out and "restoring step" in out, out
    assert "died at step" in out
    assert "restarted and restored step" in out
    assert "OK:" in out and "bitwise" in out
