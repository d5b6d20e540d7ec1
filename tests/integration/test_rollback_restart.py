"""Rollbacks against a real ``ckptd serve``: across a restart of the job's
processes (the process that set the marker dies before anything clears it, the
restarted one restores at start-up, before its first ``step``, and must not be
rolled back again; the marker ends once a step past it commits), and while the
server is away or slow (the step to go back to is unknown, not "nothing
committed"; the marker is set once it is back; a rollback request does not
queue behind a snapshot request)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.health.agent import HealthAgent
from ckptd.client.health.readings import ScriptedSource
from ckptd.errors import RollbackRequested
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.2
ECC = "gpu_ecc_uncorrected_volatile[0]"


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


def test_a_nan_while_the_server_is_away_says_the_step_is_unknown_and_marks_later(
    tmp_path: Path, shm: Path
) -> None:
    """``rollback_to=None`` alone means "nothing committed"; a server that does not
    answer gives ``rollback_unknown`` (restore the latest), and the marker is set
    for the other ranks once it is back."""
    server = ServerProcess(store=tmp_path / "store", extra_args=[
        "--heartbeat-interval", str(INTERVAL), "--dead-after", "3"])
    server.start()
    job = "nan-server-away"
    c = Checkpointer(server.url, job, shm_dir=shm, timeout=2.0)
    try:
        c.save(5, state(5)).wait(30)
        c.step(5, loss=1.0)
        server.stop()
        started = time.monotonic()
        with pytest.raises(RollbackRequested) as raised:
            c.step(6, loss=math.nan)
        # At once: one try of the agent's (nothing listens), not the Checkpointer's
        # retries of `latest` (3 s before).
        assert time.monotonic() - started < 1.0
        assert raised.value.rollback_to is None and raised.value.rollback_unknown
        server.start()
        deadline = time.monotonic() + 15
        while marker(server, job) is None:
            assert time.monotonic() < deadline, "the marker was never set"
            time.sleep(0.2)
        assert marker(server, job) == 5
        # This rank went on without it: it is told, as every other rank is.
        heard_of_marker(c, 5)
        with pytest.raises(RollbackRequested) as told:
            c.step(7, loss=1.0)
        assert told.value.rollback_to == 5 and not told.value.rollback_unknown
    finally:
        c.close(timeout=5)
        server.stop()


def test_nothing_committed_is_not_unknown(srv: ServerProcess, shm: Path) -> None:
    c = Checkpointer(srv.url, "nan-nothing", shm_dir=shm, timeout=10.0)
    try:
        with pytest.raises(RollbackRequested) as raised:
            c.step(1, loss=math.nan)
        assert raised.value.rollback_to is None and not raised.value.rollback_unknown
    finally:
        c.close()


def test_a_rollback_request_does_not_wait_behind_a_slow_snapshot_request(
    srv: ServerProcess, shm: Path, tmp_path: Path
) -> None:
    job = "rollback-not-queued"
    policy = tmp_path / "policy.toml"
    policy.write_text("[probe]\ninterval_s = 0.05\n[actions]\nsnapshot_min_interval_s = 0\n")
    c = Checkpointer(srv.url, job, shm_dir=shm, timeout=30.0)
    source = ScriptedSource([{ECC: 0}])
    agent = HealthAgent(srv.url, job, 0, 1, policy=policy, sources=[source],
                        heartbeat=c.heartbeat, latest=c.latest, timeout=1.5)
    server = agent._server
    assert server is not None
    entered = threading.Event()
    ask = server.snapshot_request

    def slow_snapshot_request(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        time.sleep(4.0)  # a server slow to answer: longer than the agent's timeout
        return ask(*args, **kwargs)

    server.snapshot_request = slow_snapshot_request  # type: ignore[method-assign]
    agent.start()
    try:
        c.save(1, state(1)).wait(30)
        agent.step(1, 1.0)
        source.push({ECC: 1})  # degraded: the snapshot request goes out, slowly
        assert entered.wait(10)
        started = time.monotonic()
        with pytest.raises(RollbackRequested) as raised:
            agent.step(2, math.nan)
        assert raised.value.rollback_to == 1, raised.value
        assert time.monotonic() - started < 1.5
        assert marker(srv, job) == 1
    finally:
        agent.close()
        c.close()
