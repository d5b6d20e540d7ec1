"""Coordinated snapshots and rollback (docs/API.md, "Liveness, restore plans,
coordination") against a real ``ckptd serve`` process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ckptd.format import CommitRecord, Ref
from ckptd.server.registry import Registry, SnapshotDecision
from tests.conftest import ServerProcess
from tests.integration.test_api import assert_error, commit, manifest, put_manifest, tensor
from tests.integration.test_liveness import beat, ckptd, ranks, wait_for

INTERVAL = 0.2
LEAD = 3
MIN_INTERVAL = 1.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        store=tmp_path_factory.mktemp("coordination") / "store",
        extra_args=[
            "--heartbeat-interval", str(INTERVAL), "--dead-after", "3",
            "--snapshot-lead", str(LEAD), "--snapshot-min-interval", str(MIN_INTERVAL),
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30.0) as c:
        yield c


def ask_snapshot(client: httpx.Client, job: str, rank: int, reason: str) -> dict[str, Any]:
    r = client.post(f"/v1/jobs/{job}/snapshot-requests", json={"rank": rank, "reason": reason})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def commit_step(client: httpx.Client, job: str, step: int, world: int, **meta: Any) -> None:
    for rank in range(world):
        e = tensor(client, "w", rows=(rank, rank + 1), global_rows=world)
        assert put_manifest(client, manifest(job, step, rank, world, [e])).status_code == 201
    r = commit(client, job, step, meta=meta)
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def events(client: httpx.Client, job: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/jobs/{job}/events")
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["events"]
    return found


# -- coordinated snapshots -----------------------------------------------------------


def test_snapshot_target_is_ahead_of_the_fastest_live_rank(client: httpx.Client) -> None:
    job = "coord-target"
    beat(client, job, 2, 3, step=500)  # the fastest, but about to die

    def rank2_dead() -> bool:
        beat(client, job, 0, 3, step=10)
        beat(client, job, 1, 3, step=12)
        return {r["rank"]: r["state"] for r in ranks(client, job)["ranks"]}[2] == "dead"

    wait_for(rank2_dead)
    answer = ask_snapshot(client, job, 1, "gpu ECC errors")
    assert answer == {"snapshot_at": 12 + LEAD, "reason": "gpu ECC errors", "accepted": True}
    # Every rank's heartbeat reply carries it, and the ranks listing shows it.
    for rank in range(2):
        reply = beat(client, job, rank, 3, step=13)
        assert (reply["snapshot_at"], reply["snapshot_reason"]) == (15, "gpu ECC errors")
    assert ranks(client, job)["snapshot_at"] == 15
    event = events(client, job)[-1]
    assert (event["kind"], event["rank"], event["step"], event["reason"]) == (
        "snapshot_requested", 1, 15, "gpu ECC errors",
    )


def test_target_stays_until_a_commit_at_or_after_it(client: httpx.Client) -> None:
    job = "coord-until-commit"
    for rank in range(2):
        beat(client, job, rank, 2, step=20)
    first = ask_snapshot(client, job, 0, "host memory low")
    assert first["accepted"] and first["snapshot_at"] == 20 + LEAD
    target = first["snapshot_at"]
    # A second request while it is pending gets the same target, not accepted.
    beat(client, job, 1, 2, step=40)
    again = ask_snapshot(client, job, 1, "gpu hot")
    assert again == {"snapshot_at": target, "reason": "host memory low", "accepted": False}

    commit_step(client, job, target - 1, 2)  # before the target: still pending
    assert beat(client, job, 0, 2, step=target)["snapshot_at"] == target
    commit_step(client, job, target, 2, reason="health", requested_by=0)
    for rank in range(2):
        reply = beat(client, job, rank, 2, step=target + 1)
        assert reply["snapshot_at"] is None and reply["snapshot_reason"] is None
    record = client.get(f"/v1/jobs/{job}/steps/{target}").json()
    assert record["meta"] == {"reason": "health", "requested_by": 0}
    kinds = [e["kind"] for e in events(client, job)]
    assert kinds == ["snapshot_requested", "snapshot_committed"]


def test_snapshot_requests_are_rate_limited(client: httpx.Client) -> None:
    job = "coord-rate"
    beat(client, job, 0, 1, step=100)
    first = ask_snapshot(client, job, 0, "degraded")
    assert first["accepted"]
    commit_step(client, job, first["snapshot_at"], 1, reason="health")
    assert beat(client, job, 0, 1, step=first["snapshot_at"] + 1)["snapshot_at"] is None
    # Committed, but set less than the minimum interval ago: refused, naming the last one.
    soon = ask_snapshot(client, job, 0, "degraded again")
    assert soon == {"snapshot_at": first["snapshot_at"], "reason": "degraded", "accepted": False}
    time.sleep(MIN_INTERVAL + 0.1)
    beat(client, job, 0, 1, step=200)
    later = ask_snapshot(client, job, 0, "degraded again")
    assert later == {"snapshot_at": 200 + LEAD, "reason": "degraded again", "accepted": True}


def test_snapshot_request_without_steps_goes_past_latest(client: httpx.Client) -> None:
    job = "coord-no-steps"
    commit_step(client, job, 50, 1)
    answer = ask_snapshot(client, job, 0, "manual")
    assert answer == {"snapshot_at": 50 + LEAD, "reason": "manual", "accepted": True}


def test_snapshot_request_input_is_checked(client: httpx.Client) -> None:
    path = "/v1/jobs/coord-bad/snapshot-requests"
    assert_error(client.post(path, json={"rank": 0}), 400, "invalid_request")
    assert_error(client.post(path, json={"rank": -1, "reason": "x"}), 400, "invalid_request")
    assert_error(client.post(path, json={"rank": 0, "reason": ""}), 400, "invalid_request")
    assert_error(client.post(path, json={"rank": 0, "reason": "x" * 1025}), 400, "invalid_request")


def test_targets_expire_and_rate_limit_on_the_registry_clock() -> None:
    now = [1000.0]
    registry = Registry(interval=2.0, dead_after=3, snapshot_lead=2, snapshot_min_interval=30.0,
                        snapshot_timeout=600.0, clock=lambda: now[0], wall=lambda: now[0])
    ask = registry.request_snapshot
    registry.heartbeat("j", 0, world_size=1, step=10)
    assert ask("j", 0, "hot", latest=None) == SnapshotDecision(12, "hot", True)
    now[0] += 599.0
    registry.heartbeat("j", 0, world_size=1, step=11)  # a loop stuck short of the target
    target = registry.pending_target("j", latest=None)
    assert target is not None and target.step == 12
    now[0] += 2.0
    assert registry.pending_target("j", latest=None) is None
    assert [e.kind for e in registry.events("j")] == ["snapshot_requested", "snapshot_expired"]
    # Expired long after the minimum interval: a new request is accepted.
    assert ask("j", 0, "hot", latest=None) == SnapshotDecision(13, "hot", True)
    registry.note_commit("j", 13)
    assert ask("j", 0, "again", latest=13) == SnapshotDecision(13, "hot", False)
    now[0] += 30.0
    assert ask("j", 0, "again", latest=13).accepted


# -- rollback ------------------------------------------------------------------------


def test_rollback_route_shows_in_heartbeat_replies(
    client: httpx.Client, srv: ServerProcess
) -> None:
    job = "coord-rollback"
    commit_step(client, job, 30, 2)
    commit_step(client, job, 40, 2)
    beat(client, job, 0, 2, step=45)
    r = client.post(f"/v1/jobs/{job}/rollback", json={"step": 30, "reason": "loss is NaN"})
    assert r.status_code == 200 and r.json() == {"rollback_to": 30, "epoch": 1}
    assert client.get(f"/v1/jobs/{job}/rollback").json() == {"rollback_to": 30, "epoch": 1}
    assert beat(client, job, 0, 2, step=46)["rollback_to"] == 30
    assert ranks(client, job)["rollback_to"] == 30
    # Durable: a ref in the store naming the committed step and its commit record.
    ref = Ref.parse((srv.store / "jobs" / job / "refs" / "rollback").read_bytes())
    assert ref.step == 30
    record = CommitRecord.parse((srv.store / "jobs" / job / "steps" / "30" / "commit.json")
                                .read_bytes())
    assert ref.commit == record.digest()
    event = events(client, job)[-1]
    assert (event["kind"], event["step"], event["reason"]) == ("rollback_set", 30, "loss is NaN")

    r = client.delete(f"/v1/jobs/{job}/rollback")
    assert r.status_code == 200 and r.json() == {"rollback_to": None, "epoch": 1}
    assert beat(client, job, 0, 2, step=47)["rollback_to"] is None
    assert not (srv.store / "jobs" / job / "refs" / "rollback").exists()
    assert events(client, job)[-1]["kind"] == "rollback_cleared"
    # Clearing twice is fine; the timeline stays.
    assert client.delete(f"/v1/jobs/{job}/rollback").status_code == 200
    assert client.get(f"/v1/jobs/{job}/rollback").json() == {"rollback_to": None, "epoch": 1}


def test_rollback_asked_again_from_the_ended_timeline_is_one_rollback(
    client: httpx.Client
) -> None:
    """Two ranks' losses turn NaN in the same timeline: one rollback, one event."""
    job = "coord-rollback-twice"
    commit_step(client, job, 10, 2)
    commit_step(client, job, 20, 2)
    first = client.post(f"/v1/jobs/{job}/rollback", json={"step": 20, "from_epoch": 0})
    assert first.json() == {"rollback_to": 20, "epoch": 1}
    again = client.post(f"/v1/jobs/{job}/rollback", json={"step": 10, "from_epoch": 0})
    assert again.json() == {"rollback_to": 20, "epoch": 1}
    assert [e["step"] for e in events(client, job) if e["kind"] == "rollback_set"] == [20]
    later = client.post(f"/v1/jobs/{job}/rollback", json={"step": 20, "from_epoch": 1})
    assert later.json() == {"rollback_to": 20, "epoch": 2}  # a new NaN: a new rollback
    assert_error(client.post(f"/v1/jobs/{job}/rollback", json={"step": 20, "from_epoch": -1}),
                 400, "invalid_request")


def test_rollback_is_refused_for_a_step_that_did_not_commit(client: httpx.Client) -> None:
    job = "coord-rollback-refused"
    e = tensor(client, "w", rows=(0, 1), global_rows=2)
    assert put_manifest(client, manifest(job, 8, 0, 2, [e])).status_code == 201
    assert_error(client.post(f"/v1/jobs/{job}/rollback", json={"step": 8}), 409, "not_committed")
    assert_error(client.post(f"/v1/jobs/{job}/rollback", json={"step": 9}),
                 404, "checkpoint_not_found")
    assert_error(client.post(f"/v1/jobs/{job}/rollback", json={"step": -1}),
                 400, "invalid_request")
    assert beat(client, job, 0, 2)["rollback_to"] is None


def test_rollback_cli_sets_and_clears(client: httpx.Client, srv: ServerProcess) -> None:
    job = "coord-rollback-cli"
    commit_step(client, job, 70, 1)
    out = ckptd("rollback", job, "70", "--reason", "bad data shard", "--url", srv.url)
    assert out.returncode == 0, out.stderr
    assert "70" in out.stdout
    assert beat(client, job, 0, 1, step=75)["rollback_to"] == 70
    assert events(client, job)[-1]["reason"] == "bad data shard"

    out = ckptd("rollback", job, "71", "--url", srv.url)
    assert out.returncode == 2 and "checkpoint_not_found" in out.stderr
    assert beat(client, job, 0, 1, step=75)["rollback_to"] == 70

    out = ckptd("rollback", job, "--clear", "--url", srv.url)
    assert out.returncode == 0, out.stderr
    assert beat(client, job, 0, 1, step=76)["rollback_to"] is None

    out = ckptd("rollback", job, "--url", srv.url)  # neither a step nor --clear
    assert out.returncode == 2


def test_the_lead_grows_when_steps_are_fast_against_the_heartbeat() -> None:
    # 2 s heartbeats and 0.25 s steps: a target only 2 steps ahead would be passed
    # before any rank heard of it; ceil(2 * 2 / 0.25) + 1 = 17 steps are needed.
    now = [1000.0]
    registry = Registry(interval=2.0, dead_after=3, snapshot_lead=2, snapshot_min_interval=0.0,
                        snapshot_timeout=600.0, clock=lambda: now[0], wall=lambda: now[0])
    fast = {"state": "ok", "reasons": [], "signals": {"step_time_median_s": 0.25}}
    slow = {"state": "ok", "reasons": [], "signals": {"step_time_median_s": 30.0}}
    registry.heartbeat("j", 0, world_size=2, step=100, health=slow)
    assert registry.request_snapshot("j", 0, "hot", latest=None).step == 102
    registry.note_commit("j", 102)
    registry.heartbeat("j", 1, world_size=2, step=103, health=fast)
    assert registry.request_snapshot("j", 1, "hot", latest=102).step == 103 + 17


def test_the_lead_follows_the_asking_ranks_pace_when_steps_just_slowed() -> None:
    # Heartbeats still carry the median of fast steps (0.05 s: 81 steps ahead), but
    # the rank asks because its last steps took 1.0 s (a slow node holds every rank
    # back): at that pace 2 intervals are 4 steps, so the target is 5 steps ahead,
    # seconds away instead of 81 steps (81 s) away.
    now = [1000.0]
    registry = Registry(interval=2.0, dead_after=3, snapshot_lead=2, snapshot_min_interval=0.0,
                        snapshot_timeout=600.0, clock=lambda: now[0], wall=lambda: now[0])
    before = {"state": "ok", "reasons": [], "signals": {"step_time_median_s": 0.05}}
    for rank in (0, 1):
        registry.heartbeat("j", rank, world_size=2, step=110, health=before)
    assert registry.request_snapshot("j", 0, "slow", latest=None, pace=1.0).step == 110 + 5
    registry.note_commit("j", 115)
    # A faster pace than the heartbeats' does not lengthen the lead, nor does one
    # where heartbeats report no pace yet (the configured lead, 2).
    assert registry.request_snapshot("j", 1, "hot", latest=115, pace=0.001).step == 115 + 81
    registry.heartbeat("k", 0, world_size=1, step=7, health={"state": "ok", "reasons": []})
    assert registry.request_snapshot("k", 0, "hot", latest=None, pace=0.001).step == 7 + 2


def test_a_snapshot_request_carries_the_askers_pace(client: httpx.Client) -> None:
    body = {"rank": 0, "reason": "slow", "step_time_s": 1.5}
    resp = client.post("/v1/jobs/pace/snapshot-requests", json=body)
    assert resp.status_code == 200, resp.text
    assert client.post("/v1/jobs/pace/snapshot-requests",
                       json={**body, "step_time_s": -1}).status_code == 400
