"""Heartbeats, liveness and restore plans (docs/API.md, "Liveness, restore plans,
coordination") against a real ``ckptd serve`` process with a short interval."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.format import RankManifest
from ckptd.hashing import document_hash
from ckptd.server.registry import rank_state
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess
from tests.integration.test_api import assert_error, commit, manifest, put_manifest, tensor

INTERVAL = 0.2
DEAD_AFTER = 3
# Peer URLs here are made up (h0, 10.0.0.1): no check of where they point (issue 10 #13).
FAST = ["--heartbeat-interval", str(INTERVAL), "--dead-after", str(DEAD_AFTER),
        "--peer-networks", "any"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(store=tmp_path_factory.mktemp("liveness") / "store", extra_args=FAST)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30.0) as c:
        yield c


def beat(client: httpx.Client, job: str, rank: int, world: int, **body: Any) -> dict[str, Any]:
    r = client.post(f"/v1/jobs/{job}/ranks/{rank}/heartbeat", json={"world_size": world, **body})
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def ranks(client: httpx.Client, job: str) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job}/ranks")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def states(client: httpx.Client, job: str) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in ranks(client, job)["ranks"]}


def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.05)


@contextlib.contextmanager
def beating(url: str, job: str, world: int, bodies: dict[int, dict[str, Any]]) -> Iterator[None]:
    """Keeps the ranks of ``bodies`` heartbeating (every half interval) meanwhile."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=url, timeout=10.0) as c:
            while not stop.is_set():
                for rank, body in bodies.items():
                    beat(c, job, rank, world, **body)
                stop.wait(INTERVAL / 2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def data_parallel_step(client: httpx.Client, job: str, step: int, world: int) -> list[RankManifest]:
    """A committed step: one replicated tensor (same chunks on every rank) and one
    tensor split by rows (each rank's own chunks)."""
    replicated = os.urandom(64 * 1024)
    manifests = []
    for rank in range(world):
        w = tensor(client, "w", rows=(0, 64), global_rows=64, placement="replicated",
                   data=replicated)
        s = tensor(client, "s", rows=(rank * 16, rank * 16 + 16), global_rows=16 * world)
        m = manifest(job, step, rank, world, [w, s])
        assert put_manifest(client, m).status_code == 201
        manifests.append(m)
    r = commit(client, job, step, meta={"reason": "periodic"})
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    return manifests


# -- the pure liveness rule ----------------------------------------------------------


def test_rank_state_is_a_function_of_now_and_the_last_heartbeat() -> None:
    kw = {"interval": 2.0, "dead_after": 3}
    assert rank_state(100.0, 100.0, "ok", **kw) == "alive"
    assert rank_state(105.9, 100.0, "degraded", **kw) == "degraded"
    assert rank_state(106.0, 100.0, "critical", **kw) == "critical"  # exactly 3 intervals
    assert rank_state(106.01, 100.0, "ok", **kw) == "dead"
    assert rank_state(106.01, 100.0, "degraded", **kw) == "dead"
    assert rank_state(50.0, 100.0, "ok", **kw) == "alive"  # a clock behind is not death


# -- heartbeats ---------------------------------------------------------------------


def test_heartbeats_make_ranks_alive(client: httpx.Client) -> None:
    job = "live-alive"
    for rank in range(2):
        reply = beat(
            client, job, rank, 2, step=7, held_step=5, peer_url=f"http://10.0.0.{rank}:9000",
            rtt_ms=1.5,
            health={"state": "ok", "reasons": [], "signals": {"gpu_temperature_c[0]": 61}},
        )
        assert reply == {
            "interval_s": INTERVAL, "snapshot_at": None, "snapshot_reason": None,
            "rollback_to": None, "rollback_epoch": 0,
            # The job's peer token (issue 10 #13), checked in tests/hostile.
            "peer_token": reply["peer_token"], "peer_url_refused": None,
            "launch_conflict": None,
        }
    body = ranks(client, job)
    assert body["job"] == job and body["world_size"] == 2
    assert body["latest"] is None and body["snapshot_at"] is None and body["rollback_to"] is None
    r0 = body["ranks"][0]
    assert r0["rank"] == 0 and r0["state"] == "alive"
    assert (r0["step"], r0["held_step"], r0["peer_url"]) == (7, 5, "http://10.0.0.0:9000")
    assert r0["rtt_ms"] == 1.5 and 0 <= r0["age_s"] < 5
    assert abs(r0["last_heartbeat"] - time.time()) < 5
    assert r0["health"] == {
        "state": "ok", "reasons": [], "signals": {"gpu_temperature_c[0]": 61},
    }


def test_health_state_shows_as_degraded_or_critical(client: httpx.Client) -> None:
    job = "live-health"
    beat(client, job, 0, 3)  # health defaults to ok
    beat(client, job, 1, 3, health={"state": "degraded", "reasons": ["gpu ECC errors"],
                                    "signals": {"gpu_ecc_uncorrected_volatile[0]": 4}})
    # Python's json writes NaN (httpx refuses to): what a careless client sends. JSON
    # has no NaN: refused in one line, as every body is; our ranks send the text.
    body = {"world_size": 3, "health": {"state": "critical", "reasons": ["loss is NaN"],
                                        "signals": {"loss": float("nan")}}}
    r = client.post(f"/v1/jobs/{job}/ranks/2/heartbeat", content=json.dumps(body),
                    headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_request")
    assert "NaN is no JSON number" in r.json()["message"]
    body["health"]["signals"] = {"loss": "nan"}
    r = client.post(f"/v1/jobs/{job}/ranks/2/heartbeat", json=body)
    assert r.status_code == 200, r.text
    body = ranks(client, job)
    assert [r["state"] for r in body["ranks"]] == ["alive", "degraded", "critical"]
    assert body["ranks"][1]["health"]["reasons"] == ["gpu ECC errors"]
    # JSON has no NaN: the reading is kept as text.
    assert body["ranks"][2]["health"]["signals"] == {"loss": "nan"}


def test_a_silent_rank_is_dead_after_the_missed_intervals(client: httpx.Client) -> None:
    job = "live-dead"
    beat(client, job, 0, 2)
    beat(client, job, 1, 2)
    last = time.monotonic()
    assert states(client, job) == {0: "alive", 1: "alive"}

    def rank1_dead() -> bool:
        beat(client, job, 0, 2)  # rank 0 keeps beating
        return states(client, job)[1] == "dead"

    wait_for(rank1_dead, timeout=5.0)
    assert time.monotonic() - last >= INTERVAL * DEAD_AFTER * 0.9
    assert states(client, job)[0] == "alive"
    events = client.get(f"/v1/jobs/{job}/events").json()["events"]
    assert [(e["kind"], e["rank"]) for e in events] == [("rank_dead", 1)]
    # A heartbeat brings it back.
    beat(client, job, 1, 2)
    assert states(client, job) == {0: "alive", 1: "alive"}
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{job}/events").json()["events"]]
    assert kinds == ["rank_dead", "rank_back"]


def test_heartbeat_input_is_checked(client: httpx.Client) -> None:
    path = "/v1/jobs/live-bad/ranks/{}/heartbeat"
    assert_error(client.post(path.format(4), json={"world_size": 4}), 400, "invalid_name")
    assert_error(client.post(path.format(0), json={}), 400, "invalid_request")
    assert_error(client.post(path.format(0), json={"world_size": 0}), 400, "invalid_request")
    for bad in (
        {"health": {"state": "sick"}},
        {"peer_url": "file:///etc/passwd"},
        {"step": -1},
        {"surprise": 1},
        {"health": {"reasons": ["x" * 1025]}},
    ):
        r = client.post(path.format(0), json={"world_size": 1, **bad})
        assert_error(r, 400, "invalid_request")
    assert_error(client.post("/v1/jobs/..x/ranks/0/heartbeat", json={"world_size": 1}),
                 400, "invalid_name")
    # Nothing of that was kept.
    assert ranks(client, "live-bad")["ranks"] == []


def test_heartbeats_need_the_token(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store", token="t0k", extra_args=FAST)
    srv.start()
    try:
        body = {"world_size": 1}
        r = httpx.post(f"{srv.url}/v1/jobs/j/ranks/0/heartbeat", json=body)
        assert_error(r, 401, "unauthorized")
        assert_error(httpx.get(f"{srv.url}/v1/jobs/j/restore-plan?rank=0"), 401, "unauthorized")
        r = httpx.post(f"{srv.url}/v1/jobs/j/ranks/0/heartbeat", json=body, headers=srv.headers())
        assert r.status_code == 200
    finally:
        srv.stop()


# -- restore plans ------------------------------------------------------------------


def test_restore_plan_lists_live_peers_that_hold_each_chunk(client: httpx.Client) -> None:
    job, step, world = "live-plan", 10, 4
    manifests = data_parallel_step(client, job, step, world)
    url = {r: f"http://127.0.0.{r + 1}:7000" for r in range(world)}
    # Rank 3 holds the step but goes silent; rank 2 holds an older step.
    beat(client, job, 3, world, held_step=step, peer_url=url[3])
    time.sleep(INTERVAL * DEAD_AFTER + 0.2)
    beat(client, job, 0, world, held_step=step, peer_url=url[0])  # the restoring rank itself
    beat(client, job, 1, world, held_step=step, peer_url=url[1],
         health={"state": "degraded", "reasons": ["hot"]})
    beat(client, job, 2, world, held_step=step - 1, peer_url=url[2])
    assert states(client, job)[3] == "dead"

    r = client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0, "step": step})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert (plan["job"], plan["step"], plan["rank"], plan["world_size"]) == (job, step, 0, world)
    mine = manifests[0]
    assert RankManifest.model_validate(plan["manifest"]) == mine
    assert plan["manifest_hash"] == mine.digest()
    assert document_hash(RankManifest.model_validate(plan["manifest"]).canonical()) == (
        plan["manifest_hash"]
    )
    replicated = {e.name: e.chunks for e in mine.entries}["w"]
    own = {e.name: e.chunks for e in mine.entries}["s"]
    assert set(plan["peers"]) == set(replicated) | set(own)
    for cid in replicated:  # rank 1 only: not rank 0 itself, not dead 3, not 2 (older step)
        assert plan["peers"][cid] == [url[1]]
    for cid in own:  # nobody else holds rank 0's rows
        assert plan["peers"][cid] == []

    # Without a step: the latest committed one.
    again = client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0}).json()
    assert again == plan
    # Rank 3 restoring: its replicated chunks from 0 and 1 (both live, holding the step).
    plan3 = client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 3}).json()
    w3 = {e.name: e.chunks for e in manifests[3].entries}["w"]
    assert all(sorted(plan3["peers"][c]) == sorted([url[0], url[1]]) for c in w3)
    # The healthier peer is named first.
    assert all(plan3["peers"][c][0] == url[0] for c in w3)


def test_restore_plan_errors(client: httpx.Client) -> None:
    job = "live-plan-errors"
    assert_error(client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0}),
                 404, "checkpoint_not_found")
    e = tensor(client, "w", rows=(0, 1), global_rows=2)
    assert put_manifest(client, manifest(job, 3, 0, 2, [e])).status_code == 201
    assert_error(client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0, "step": 3}),
                 409, "not_committed")
    assert_error(client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": -1}),
                 400, "invalid_name")
    assert_error(client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": "x"}),
                 400, "invalid_name")
    data_parallel_step(client, job, 5, 2)
    # (a rank past the step's world has no manifest: 404, as GET of its manifest)
    assert_error(client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 2, "step": 5}),
                 404, "manifest_not_found")


# -- soft state ---------------------------------------------------------------------


def test_a_restart_loses_soft_state_and_heartbeats_rebuild_it(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store", extra_args=FAST)
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            job = "live-restart"
            manifests = data_parallel_step(c, job, 4, 2)
            replicated = set({e.name: e.chunks for e in manifests[0].entries}["w"])
            for rank in range(2):
                beat(c, job, rank, 2, step=6, held_step=4, peer_url=f"http://h{rank}:1")
            assert c.post(f"/v1/jobs/{job}/rollback", json={"step": 4}).status_code == 200
            assert states(c, job) == {0: "alive", 1: "alive"}
        srv.restart()
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            body = ranks(c, job)
            assert body["ranks"] == [] and body["world_size"] is None
            assert body["latest"] == 4  # durable state is still there
            assert body["rollback_to"] == 4  # the rollback marker is a ref in the store
            plan = c.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0}).json()
            assert all(peers == [] for peers in plan["peers"].values())
            for rank in range(2):
                reply = beat(c, job, rank, 2, step=6, held_step=4, peer_url=f"http://h{rank}:1")
                assert reply["rollback_to"] == 4
            assert states(c, job) == {0: "alive", 1: "alive"}
            plan = c.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0}).json()
            assert {cid for cid, peers in plan["peers"].items() if peers == ["http://h1:1"]} == (
                replicated
            )
    finally:
        srv.stop()


# -- ckptd status -------------------------------------------------------------------


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="220", NO_COLOR="1", TERM="dumb")
    env.pop("CKPTD_TOKEN", None)
    env.pop("CKPTD_URL", None)
    return run_ckptd(*args, environ=env)


def test_status_prints_a_table_with_a_dead_and_a_degraded_rank(
    client: httpx.Client, srv: ServerProcess
) -> None:
    job = "live-status"
    data_parallel_step(client, job, 2, 3)
    beat(client, job, 2, 3, step=9)
    time.sleep(INTERVAL * DEAD_AFTER + 0.2)
    # As the probe names them: one reading per GPU; the hottest and the sum are shown.
    signals = {"gpu_temperature_c[0]": 91.0, "gpu_temperature_c[1]": 77,
               "gpu_ecc_uncorrected_volatile[0]": 2, "gpu_ecc_uncorrected_volatile[1]": 1,
               "host_memory_percent": 72.4, "disk_free_percent[/" + "d" * 300 + "]": 40.0,
               "gpu_xid_last[0]": "unavailable"}
    live = {
        0: {"step": 9, "held_step": 2, "rtt_ms": 0.8},
        1: {"step": 9, "held_step": 2,
            "health": {"state": "degraded", "reasons": ["gpu ECC errors"], "signals": signals}},
    }
    with beating(srv.url, job, 3, live):
        out = ckptd("status", job, "--url", srv.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(job in line and "last committed 2" in line for line in lines), out.stdout
    row = {int(line.split()[1]): line for line in lines
           if line.strip().startswith("│") and line.split()[1].isdigit()}
    assert "alive" in row[0] and "0.8 ms" in row[0]
    assert "degraded" in row[1] and "gpu ECC errors" in row[1]
    assert "91 °C" in row[1] and "72 %" in row[1] and " 3 " in row[1]
    assert "dead" in row[2] and "no heartbeat" in row[2]
    assert "rank_dead" in out.stdout

    # --watch N refreshes for N seconds, then exits.
    started = time.monotonic()
    with beating(srv.url, job, 3, live):
        out = ckptd("status", job, "--url", srv.url, "--watch", "0.6", "--every", "0.2")
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 30
    assert "degraded" in out.stdout

    out = ckptd("status", "--url", "http://127.0.0.1:1")
    assert out.returncode == 2 and "unavailable" in out.stderr
