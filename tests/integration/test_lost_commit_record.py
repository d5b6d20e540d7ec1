"""A committed step whose commit record is gone while ``latest`` (or a tag) names
it is damage, not a step that "never committed": restore, export and diff of it
say ``store_corrupt`` naming the missing record and exit 1, as ``ls`` and
``verify`` call it damaged (docs/operations.md). Found by a probe: the three
said ``not_committed``, exit 2, blaming the caller."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(180)

JOB = "lost"


@pytest.fixture
def store(tmp_path: Path, shm: Path) -> Path:
    root = tmp_path / "store"
    with Checkpointer(f"file://{root}", JOB, rank=0, world_size=1, shm_dir=shm,
                      serve_peers=False, heartbeat_interval=0) as ckpt:
        for step in (6, 7):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait(60)
    (root / "jobs" / JOB / "steps" / "7" / "commit.json").unlink()
    return root


def _ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return run_ckptd(*args, environ={**os.environ, "COLUMNS": "300"}, timeout=120)


def _commands(url: str, tmp_path: Path) -> list[list[str]]:
    return [["restore", "--job", JOB, "--rank", "0", "--step", "7", "--to",
             str(tmp_path / "to"), "--url", url],
            ["export", JOB, "7", "--safetensors", str(tmp_path / "out"), "--url", url],
            ["diff", JOB, "6", "7", "--url", url]]


def _assert_damage_named(done: subprocess.CompletedProcess[str]) -> None:
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "store_corrupt" in said and f"jobs/{JOB}/steps/7/commit.json" in said, said
    assert "never committed" not in said and "Traceback" not in said, said


def test_a_lost_commit_record_is_damage_read_from_the_store(store: Path,
                                                            tmp_path: Path) -> None:
    for command in _commands(f"file://{store}", tmp_path):
        _assert_damage_named(_ckptd(*command))


def test_a_lost_commit_record_is_damage_through_a_server(store: Path, tmp_path: Path) -> None:
    server = ServerProcess(store=store)
    server.start()
    try:
        for command in _commands(server.url, tmp_path):
            _assert_damage_named(_ckptd(*command))
    finally:
        server.stop()
