"""SIGTERM ends a ``ckptd`` command as Ctrl-C does, with exit 143, also as a
container's first process: the kernel kills no PID 1 for a signal it has no
handler for, so an init container's ``ckptd restore`` or a Job's ``ckptd gc``
(the image's ``ENTRYPOINT ["ckptd"]``) waited out the grace period, then SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.listeners import silent_listener

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A listener that takes connections and never answers (a stopped server)."""
    with silent_listener() as url:
        yield url


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_ANSWER_WITHIN"] = "90"  # (it would wait that long for an answer)
    return env


def _terminated(proc: subprocess.Popen[str], pid: int) -> tuple[int, float, str]:
    """SIGTERM to ``pid`` once the command waits on the server; its exit code, the
    seconds it took to end, and what it wrote on stderr."""
    time.sleep(3.0)  # (its imports done, its request sent)
    stopping = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGTERM did not end the command within 20 s")
    return proc.returncode, time.monotonic() - stopping, err


def test_sigterm_ends_a_command_waiting_on_a_server(hung_url: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "ls", "--url", hung_url],
                            env=_env(), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    code, took, err = _terminated(proc, proc.pid)
    assert code == 143 and took < 10, (code, took, err)
    assert "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a PID namespace of its own needs root and unshare(1)")
def test_sigterm_ends_a_command_that_is_its_containers_first_process(hung_url: str) -> None:
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable,
                             "-m", "ckptd", "ls", "--url", hung_url],
                            env=_env(), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    children: list[psutil.Process] = []
    while not children and time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children()
        time.sleep(0.05)
    assert children, "unshare started no command"
    code, took, err = _terminated(proc, children[0].pid)  # (PID 1 in its namespace)
    assert code == 143 and took < 10, (code, took, err)
    assert "Traceback" not in err, err
