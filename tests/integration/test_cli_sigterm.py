"""SIGTERM ends a ``ckptd`` command as Ctrl-C does, with exit 143, also as a
container's first process: the kernel kills no PID 1 for a signal it has no
handler for, so an init container's ``ckptd restore`` or a Job's ``ckptd gc``
(the image's ``ENTRYPOINT ["ckptd"]``) waited out the grace period, then SIGKILL.
A SIGTERM among the imports ends it alike (no traceback, no hang)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]


class _Silent:
    """A server that takes each connection and never answers; ``asked`` is set once
    a command's request came (its imports done, its request sent)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asked = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._take, daemon=True).start()

    def _take(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            conn.settimeout(10)
            try:
                if conn.recv(1):
                    self.asked.set()
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent() -> Iterator[_Silent]:
    server = _Silent()
    yield server
    server.close()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_ANSWER_WITHIN"] = "90"  # (it would wait that long for an answer)
    return env


def _ended(proc: subprocess.Popen[str], pid: int) -> tuple[int, float, str]:
    """SIGTERM to ``pid``; the exit code, the seconds it took to end, its stderr."""
    stopping = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGTERM did not end the command within 20 s")
    return proc.returncode, time.monotonic() - stopping, err


def _ls(silent: _Silent, *before: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*before, sys.executable, "-m", "ckptd", "ls", "--url", silent.url],
                            env=_env(), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigterm_ends_a_command_waiting_on_a_server(silent: _Silent) -> None:
    proc = _ls(silent)
    assert silent.asked.wait(60), "the command sent no request"
    code, took, err = _ended(proc, proc.pid)
    assert code == 143 and took < 10, (code, took, err)
    assert "Traceback" not in err, err


@pytest.mark.parametrize("after", [i / 20 for i in range(1, 17)])
def test_sigterm_among_the_imports_ends_it_alike(silent: _Silent, after: float) -> None:
    """(Found by review: a SIGTERM there was a pydantic schema error's traceback,
    a death by SIGINT, or a hang in the interpreter's exit.)"""
    proc = _ls(silent)
    time.sleep(after)
    code, took, err = _ended(proc, proc.pid)
    if code == -signal.SIGTERM:
        # A SIGTERM before the interpreter reached ckptd's handler (its own start
        # takes some tens of ms on a loaded machine) kills it by the kernel's
        # default, as it kills any program: a shell reports that as 143 too. Then
        # nothing of ckptd ran, so nothing was said.
        assert err == "" and took < 10, (code, took, err)
        return
    assert code == 143 and took < 10, (code, took, err)
    assert "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a PID namespace of its own needs root and unshare(1)")
def test_sigterm_ends_a_command_that_is_its_containers_first_process(silent: _Silent) -> None:
    proc = _ls(silent, "unshare", "--pid", "--fork", "--kill-child")
    try:
        assert silent.asked.wait(60), "the command sent no request"
        (child,) = psutil.Process(proc.pid).children()  # (PID 1 in its namespace)
        code, took, err = _ended(proc, child.pid)
        assert code == 143 and took < 10, (code, took, err)
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


_DROPPED_WHERE_IGNORED = """
import os, signal, sys, time
import ckptd.cli
from ckptd.__main__ import main

class Dropped:
    def __del__(self):  # (Python prints an exception raised here, and drops it)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(0.5)  # (the handler runs here, inside __del__)

def command():
    Dropped()
    time.sleep(3)
    print("went on")

ckptd.cli.main = command
main()
"""


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_an_interrupt_that_lands_where_python_drops_exceptions_still_ends_it(
        sig: str, code: int) -> None:
    """The interrupt a signal's handler raises can land in a weakref's callback (the
    imports' module locks) or a ``__del__``, where Python prints it with a traceback
    and goes on: a SIGTERM's command ran on until the watchdog (found in a full
    run), a Ctrl-C's to its end."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _DROPPED_WHERE_IGNORED, sig], env=_env(),
                          cwd=REPO, text=True, capture_output=True, timeout=30)
    took = time.monotonic() - started
    assert done.returncode == code and "went on" not in done.stdout, done
    assert done.stderr == "" and took < 3, (took, done.stderr)
