"""A rank that closes cleanly says goodbye: it shows ``left``, never ``dead``, in
the ranks listing, ``ckptd status``, the events and ``/metrics``; a Checkpointer
that never saved leaves no dead ranks behind, closed or not; a killed one is dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.client import Checkpointer
from tests.conftest import ServerProcess

INTERVAL = 0.2
DEAD_AFTER = 2  # dead 0.4 s after the last heartbeat


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(store=tmp_path / "store", extra_args=[
        "--heartbeat-interval", str(INTERVAL), "--dead-after", str(DEAD_AFTER)])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def states(url: str, job: str) -> dict[int, str]:
    doc = httpx.get(f"{url}/v1/jobs/{job}/ranks", timeout=5).json()
    return {r["rank"]: r["state"] for r in doc["ranks"]}


def event_kinds(url: str, job: str) -> list[str]:
    doc: dict[str, Any] = httpx.get(f"{url}/v1/jobs/{job}/events", timeout=5).json()
    return [e["kind"] for e in doc["events"]]


def dead_in_metrics(url: str, job: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ckptd_ranks") and f'job="{job}"' in line and 'state="dead"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def past_the_dead_window() -> None:
    time.sleep(INTERVAL * DEAD_AFTER * 3)


def test_a_closed_checkpointer_that_never_saved_has_left_not_died(
    srv: ServerProcess, shm: Path
) -> None:
    job = "never-saved"
    ckpt = Checkpointer(srv.url, job=job, rank=0, world_size=2, shm_dir=shm,
                        heartbeat_interval=INTERVAL)
    wait_for(lambda: states(srv.url, job).get(0) == "alive")
    ckpt.close()
    past_the_dead_window()
    assert states(srv.url, job) == {0: "left"}
    kinds = event_kinds(srv.url, job)
    assert "rank_left" in kinds and "rank_dead" not in kinds, kinds
    assert dead_in_metrics(srv.url, job) == 0.0
    status = subprocess.run([sys.executable, "-m", "ckptd", "status", job, "--url", srv.url],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "left" in status.stdout and "dead" not in status.stdout, status.stdout


WORKER = """
import os, signal, sys, time
import torch
from ckptd.client import Checkpointer
ckpt = Checkpointer(sys.argv[1], job=sys.argv[2], shm_dir=sys.argv[3], heartbeat_interval=0.2)
# One committed step: /metrics labels only jobs that exist in the store.
ckpt.save(0, {"w": torch.zeros(4)}).wait()
print("ready", flush=True)
if sys.argv[4] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
# else: the script ends without close()
"""


@pytest.mark.parametrize("how,expected", [("exit", "left"), ("kill", "dead")])
def test_a_process_that_ends_leaves_and_a_killed_one_dies(
    srv: ServerProcess, shm: Path, how: str, expected: str
) -> None:
    job = f"process-{how}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run([sys.executable, "-c", WORKER, srv.url, job, str(shm), how],
                          capture_output=True, text=True, timeout=120, env=env)
    assert "ready" in done.stdout, done.stderr
    assert done.returncode == (-signal.SIGKILL if how == "kill" else 0), done.stderr
    past_the_dead_window()
    assert states(srv.url, job) == {0: expected}
    assert (dead_in_metrics(srv.url, job) > 0) == (expected == "dead")


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_job_relaunched_with_another_world_size_after_a_clean_close_is_heard(
    srv: ServerProcess, shm: Path, new_world: int
) -> None:
    """Ranks that said goodbye are gone: the relaunch's heartbeats (another world
    size, the same timeline) are not refused as if they were still alive."""
    job = f"relaunch-{new_world}"
    old = [Checkpointer(srv.url, job, rank=r, world_size=2, shm_dir=shm) for r in range(2)]
    wait_for(lambda: len(states(srv.url, job)) == 2)
    for c in old:
        c.close()
    assert states(srv.url, job) == {0: "left", 1: "left"}
    new = [Checkpointer(srv.url, job, rank=r, world_size=new_world, shm_dir=shm)
           for r in range(new_world)]
    try:
        wait_for(lambda: all(c.heartbeat is not None and c.heartbeat.beats >= 2 for c in new),
                 timeout=5)
        assert all(c.heartbeat is not None and c.heartbeat.failures == 0 for c in new)
        assert states(srv.url, job) == {r: "alive" for r in range(new_world)}
    finally:
        for c in new:
            c.close()
