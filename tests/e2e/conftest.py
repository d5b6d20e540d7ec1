"""Multi-process end-to-end tests: workers under ``workers/`` run with torchrun
(``python -m torch.distributed.run --standalone``), gloo on the CPU, the way users
launch training; each rank writes what it saw to ``<out>/rank<r>.json``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

WORKERS = Path(__file__).parent / "workers"


Launcher = Callable[..., list[Any]]


def run_torchrun(script: str, nproc: int, *args: str, out: Path, timeout: float = 150.0
                 ) -> list[Any]:
    """Runs ``workers/<script>`` on ``nproc`` ranks; every rank's result, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKERS / script), str(out), *args]
    env = dict(os.environ)
    env.pop("CKPTD_TOKEN", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and its workers: our own group
        output, _ = proc.communicate()
        pytest.fail(f"{script} on {nproc} ranks ran past {timeout} s:\n"
                    f"{output.decode(errors='replace')[-6000:]}")
    text = output.decode(errors="replace")
    if proc.returncode != 0:
        wrote = sorted(p.name for p in out.glob("rank*.json"))
        pytest.fail(f"{script} on {nproc} ranks exited {proc.returncode} (results written: "
                    f"{wrote or 'none'}):\n{text[-8000:]}")
    results = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} of {script} wrote no result:\n{text[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


@pytest.fixture
def torchrun() -> Launcher:
    """``torchrun(script, nproc, *args, out=folder)``: every rank's result."""
    return run_torchrun
