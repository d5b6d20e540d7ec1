"""The static checks the project holds itself to, run by the suite so CI enforces
them: mypy strict over ``ckptd/``, ``client/`` and ``server/`` (pyproject's
``[tool.mypy]``), and ruff over the whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=580)


def test_mypy_strict_is_clean_on_the_three_rooms() -> None:
    done = run("mypy", "--no-error-summary")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_ruff_is_clean() -> None:
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
