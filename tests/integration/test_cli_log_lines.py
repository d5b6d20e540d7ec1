"""A command's log records read as its own lines do (``warning: ...``), not as a
daemon's (a time, ``WARNING``, a logger's dotted name: found by a probe); a
server's keep their time and logger (tests/hostile/test_error_log.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_commands_warnings_are_plain_lines() -> None:
    url = f"http://127.0.0.1:{_closed_port()},http://127.0.0.1:{_closed_port()}"
    env = {**os.environ, "CKPTD_RETRIES": "0"}
    done = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--url", url],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "unreachable" in line]
    assert warnings and all(line.startswith("warning: ckptd replica") for line in warnings), (
        done.stderr)
    assert "WARNING" not in done.stderr and "ckptd.client." not in done.stderr, done.stderr
    verbose = subprocess.run([sys.executable, "-m", "ckptd", "-v", "ls", "--url", url],
                             capture_output=True, text=True, timeout=60, env=env)
    assert " WARNING ckptd.client." in verbose.stderr, verbose.stderr  # --verbose: all of it
