"""Coordinated snapshot targets that can no longer commit, against a real ``ckptd
serve``: a target pending when the job rolls back is dropped (the ranks go back
before it), and a target the server lost (a restart) is not saved by the rank
that asked for it alone."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
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
from tests.integration.test_health_flow import ECC, QUIET

pytestmark = pytest.mark.timeout(90)

INTERVAL = 0.2


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(store=tmp_path / "store", extra_args=[
        "--heartbeat-interval", str(INTERVAL), "--dead-after", "3", "--snapshot-lead", "3",
        "--snapshot-min-interval", "0.5"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def state(v: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(v))}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def ranks(srv: ServerProcess, shm: Path, tmp_path: Path, job: str, world: int
          ) -> list[tuple[Checkpointer, HealthAgent, ScriptedSource]]:
    policy = tmp_path / "quiet.toml"
    policy.write_text(QUIET)
    made = []
    for r in range(world):
        c = Checkpointer(srv.url, job, rank=r, world_size=world, shm_dir=shm, chunk_size=4096,
                         timeout=30.0)
        source = ScriptedSource([{ECC: 0}])
        agent = HealthAgent(srv.url, job, r, world, policy=policy, sources=[source],
                            heartbeat=c.heartbeat, latest=c.latest,
                            epoch=lambda c=c: c.epoch).start()
        made.append((c, agent, source))
    return made


def close(made: list[tuple[Checkpointer, HealthAgent, ScriptedSource]]) -> None:
    for c, agent, _ in made:
        agent.close()
        c.close(timeout=10)


def target_of(agent: HealthAgent) -> int | None:
    hb = agent._heartbeat
    reply = hb.last_reply if hb is not None else None
    return reply.snapshot_at if reply is not None else None


def test_a_target_pending_at_a_rollback_is_dropped(srv: ServerProcess, shm: Path,
                                                   tmp_path: Path) -> None:
    job = "target-rollback"
    made = ranks(srv, shm, tmp_path, job, 2)
    (c0, a0, s0), (c1, a1, _) = made
    try:
        for c, _, _ in made:
            c.save(1, state(1))
        for c, _, _ in made:
            c._saver.settle(30)
        for step in (2, 3):  # steps of 0.15 s: the server's lead stays small
            for _, a, _ in made:
                a.step(step, 1.0)
            time.sleep(0.15)
        time.sleep(3 * INTERVAL)  # the server knows both ranks' steps
        s0.push({ECC: 1})  # rank 0 degraded: it asks for a snapshot
        wait_for(lambda: target_of(a0) is not None and target_of(a1) is not None, "a target")
        target = target_of(a1)
        assert target is not None and target <= 10
        for step in range(4, target + 1):  # rank 0 gets there first and saves it
            d = a0.step(step, 1.0)
            if d.snapshot:
                c0.save(step, state(step), meta=d.meta)
        with pytest.raises(RollbackRequested):
            a1.step(4, math.nan)  # rank 1, behind, goes NaN: every rank goes back to 1
        doc = httpx.get(f"{srv.url}/v1/jobs/{job}/ranks").json()
        assert doc["snapshot_at"] is None  # dropped with the ended timeline
        wait_for(lambda: a0._heartbeat is not None and a0._heartbeat.last_reply is not None
                 and a0._heartbeat.last_reply.rollback_to == 1, "rank 0 to hear of it")
        with pytest.raises(RollbackRequested):
            a0.step(target + 1, 1.0)
        for c, a, _ in made:
            c.restore(state(0), 1)
            a.acknowledge_rollback(1)
        for step in range(2, target + 2):
            for _, a, _ in made:
                assert not a.step(step, 1.0).snapshot, step  # nobody saves it alone
        time.sleep(0.5)  # the server's --snapshot-min-interval
        answer = httpx.post(f"{srv.url}/v1/jobs/{job}/snapshot-requests",
                            json={"rank": 1, "reason": "again"}).json()
        assert answer["accepted"], answer  # no target of the ended timeline blocks it
        kinds = [e["kind"] for e in httpx.get(f"{srv.url}/v1/jobs/{job}/events").json()["events"]]
        assert "snapshot_dropped" in kinds
    finally:
        close(made)


def test_a_target_the_server_lost_is_not_saved_alone(srv: ServerProcess, shm: Path,
                                                     tmp_path: Path) -> None:
    job = "target-lost"
    made = ranks(srv, shm, tmp_path, job, 1)
    c, agent, source = made[0]
    try:
        for step in (1, 2, 3):
            agent.step(step, 1.0)
            time.sleep(0.15)
        time.sleep(3 * INTERVAL)
        source.push({ECC: 1})
        wait_for(lambda: agent.snapshot_target is not None, "the target")
        target = agent.snapshot_target
        assert target is not None and target <= 10
        srv.restart()  # soft state, the target included, is gone
        restarted = time.time()
        hb = c.heartbeat
        assert hb is not None
        wait_for(lambda: hb.last_reply is not None and hb.last_reply.received_at
                 - hb.last_reply.rtt_ms / 1000 > restarted, "a reply from the new server")
        assert hb.last_reply is not None and hb.last_reply.snapshot_at is None
        for step in range(4, target + 1):
            assert not agent.step(step, 1.0).snapshot, step
    finally:
        close(made)
