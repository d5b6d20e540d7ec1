"""A rollback across a restart of the job's processes, against a real ``ckptd
serve``: the process that set the marker dies before anything clears it, the
restarted one restores at start-up (before its first ``step``) and must not be
rolled back again, and the marker ends once a step past it commits."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import RollbackRequested
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.2


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(store=tmp_path_factory.mktemp("rollback-restart") / "store",
                           extra_args=["--heartbeat-interval", str(INTERVAL),
                                       "--dead-after", "3"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def state(v: float) -> dict[str, Any]:
    return {"w": torch.full((256,), v)}


def marker(srv: ServerProcess, job: str) -> int | None:
    value: int | None = httpx.get(f"{srv.url}/v1/jobs/{job}/rollback").json()["rollback_to"]
    return value


def heard_of_marker(ckpt: Checkpointer, step: int) -> None:
    """Waits until a heartbeat reply names the marker (bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reply = ckpt.last_heartbeat_reply
        if reply is not None and reply.rollback_to == step:
            return
        time.sleep(0.05)
    pytest.fail(f"no heartbeat reply named the marker at step {step}")


def test_a_restarted_process_that_restored_the_marker_is_not_rolled_back_again(
    srv: ServerProcess, shm: Path
) -> None:
    job = "restart-after-nan"
    first = Checkpointer(srv.url, job, shm_dir=shm, timeout=30.0)
    first.save(1, state(1)).wait(30)
    first.step(1, loss=1.0)
    with pytest.raises(RollbackRequested) as raised:
        first.step(2, loss=math.nan)
    assert raised.value.rollback_to == 1
    first.close()  # dies, as the README loop's process does: nobody restored
    assert marker(srv, job) == 1

    # torchrun starts the process again: the README loop restores latest at start.
    second = Checkpointer(srv.url, job, shm_dir=shm, timeout=30.0)
    x = state(0)
    assert second.restore(x).step == 1 and float(x["w"][0]) == 1.0
    heard_of_marker(second, 1)
    for step in (2, 3):
        second.step(step, loss=1.0)  # no RollbackRequested: it is in the new timeline
    second.save(3, state(3)).wait(30)
    # The commit past the marker, in its timeline, ended the rollback: no rank
    # needs to be alive for that.
    assert marker(srv, job) is None
    kinds = [e["kind"] for e in httpx.get(f"{srv.url}/v1/jobs/{job}/events").json()["events"]]
    assert kinds[-1] == "rollback_cleared"
    second.close()

    third = Checkpointer(srv.url, job, shm_dir=shm, timeout=30.0)
    assert third.restore(state(0)).step == 3
    time.sleep(3 * INTERVAL)
    third.step(4, loss=1.0)
    third.close()


def test_a_restarted_process_that_restored_another_step_is_told(
    srv: ServerProcess, shm: Path
) -> None:
    """A restart that restored a step of the ended timeline (committed after the
    marker, before the rollback) must still roll back to the marker."""
    job = "restart-told"
    first = Checkpointer(srv.url, job, shm_dir=shm, timeout=30.0)
    for step in (1, 2):
        first.save(step, state(step)).wait(30)
    httpx.post(f"{srv.url}/v1/jobs/{job}/rollback", json={"step": 1, "reason": "by hand"}
               ).raise_for_status()
    first.close()
    second = Checkpointer(srv.url, job, shm_dir=shm, timeout=30.0)
    assert second.restore(state(0), 2).step == 2
    heard_of_marker(second, 1)
    with pytest.raises(RollbackRequested) as raised:
        second.step(3, loss=1.0)
    assert raised.value.rollback_to == 1
    second.close()
