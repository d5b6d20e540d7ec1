"""The health flow end to end against a real ``ckptd serve`` process: scripted
probe readings on one of four ranks (threads here, each with its own
Checkpointer and HealthAgent) lead to a coordinated snapshot, a rollback, a
degraded rank and a dead one (docs/policy.md, "In the training loop")."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.health.agent import HealthAgent, StepDecision
from ckptd.client.health.readings import ScriptedSource
from ckptd.errors import RollbackRequested, Superseded
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(60)

WORLD = 4
INTERVAL = 0.2  # server heartbeat interval
DEAD_AFTER = 3
LEAD = 3
# Longer than a heartbeat interval, so that LEAD steps leave every rank time to
# hear of a target (the race docs/policy.md describes).
STEP_S = 0.25
ECC = "gpu_ecc_uncorrected_volatile[0]"

QUIET = """
[probe]
interval_s = 0.05
[actions]
snapshot_min_interval_s = 0
[signals.step_time_ratio]   # thread scheduling on a small machine is not a stall
degraded = "off"
[signals.server_rtt_ms]
degraded = "off"
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        store=tmp_path_factory.mktemp("health-flow") / "store",
        extra_args=[
            "--heartbeat-interval", str(INTERVAL), "--dead-after", str(DEAD_AFTER),
            "--snapshot-lead", str(LEAD), "--snapshot-min-interval", "0.5",
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30.0) as c:
        yield c




def state_at(step: int) -> dict[str, Any]:
    """What every rank's (replicated) state is after ``step``: deterministic."""
    return {"w": torch.full((1024,), float(step)), "step": step}


@dataclass
class Rank:
    rank: int
    ckpt: Checkpointer
    agent: HealthAgent
    source: ScriptedSource
    saved: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    decisions: list[tuple[int, StepDecision]] = field(default_factory=list)
    rollbacks: list[tuple[int, RollbackRequested]] = field(default_factory=list)
    restored: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    last_step_at: float = 0.0
    error: BaseException | None = None


@pytest.fixture
def ranks_of(srv: ServerProcess, shm: Path, tmp_path: Path) -> Iterator[Callable[..., list[Rank]]]:
    made: list[Rank] = []

    def make(job: str, policy: str = QUIET) -> list[Rank]:
        path = tmp_path / f"{job}.toml"
        path.write_text(policy)
        for r in range(WORLD):
            ckpt = Checkpointer(srv.url, job, rank=r, world_size=WORLD, token=srv.token,
                                chunk_size=4096, timeout=30.0, shm_dir=shm)
            source = ScriptedSource([{ECC: 0}], name=f"gpu-rank{r}")
            # The wiring Checkpointer.step will have: the agent shares the
            # checkpointer's heartbeat and asks it for the latest commit.
            agent = HealthAgent(srv.url, job, r, WORLD, srv.token, policy=path,
                                sources=[source], heartbeat=ckpt.heartbeat,
                                latest=ckpt.latest, epoch=lambda c=ckpt: c.epoch)
            made.append(Rank(r, ckpt, agent, source))
        for rank in made[-WORLD:]:
            rank.agent.start()
        return made[-WORLD:]

    yield make
    for rank in made:
        rank.agent.close()
        rank.ckpt.close(timeout=10.0)


def train(
    r: Rank,
    last: int,
    *,
    deadline: float,
    every: int | None = None,
    loss_at: Callable[[int], float] = lambda step: 1.0 / step,
    hook: Callable[[int], bool] = lambda step: False,
    after_rollback: int = 0,
) -> None:
    """A bounded training loop: step 1..``last`` (or until ``deadline``), saving
    every ``every`` steps and whenever the agent says so; on RollbackRequested,
    restore the step named, acknowledge, and run ``after_rollback`` more steps.
    ``hook(step)`` runs before each step; True ends the loop. A save refused as
    superseded (another rank's rollback ended the timeline) keeps the loop going
    until the agent tells of the rollback."""
    step = 1
    state = state_at(0)
    try:
        while step <= last and time.monotonic() < deadline:
            if hook(step):
                return
            state = state_at(step)
            try:
                decision = r.agent.step(step, loss_at(step))
            except RollbackRequested as exc:
                r.rollbacks.append((step, exc))
                assert exc.rollback_to is not None
                restored = state_at(-1)
                r.ckpt.restore(restored, step=exc.rollback_to)
                assert restored["step"] == exc.rollback_to
                assert torch.equal(restored["w"], state_at(exc.rollback_to)["w"])
                r.restored.append(exc.rollback_to)
                r.agent.acknowledge_rollback(exc.rollback_to)
                step = exc.rollback_to + 1
                last = min(last, exc.rollback_to + after_rollback)
                continue
            r.last_step_at = time.monotonic()
            r.decisions.append((step, decision))
            periodic = every is not None and step % every == 0
            if decision.snapshot or periodic:
                meta = decision.meta if decision.snapshot else {"reason": "periodic"}
                try:
                    r.ckpt.save(step, state, meta=meta).wait(20.0)
                except Superseded:
                    # Another rank's rollback ended this timeline before this rank's
                    # heartbeat heard of it: the agent tells it at a next step, so the
                    # loop goes on (as a real one would) until it does.
                    r.superseded.append(step)
                    last = max(last, step + 1)
                else:
                    r.saved.append((step, meta))
            time.sleep(STEP_S)
            step += 1
    except BaseException as exc:  # reported by run_ranks
        r.error = exc


def run_ranks(ranks: list[Rank], loop: Callable[[Rank], None], limit: float) -> None:
    threads = [threading.Thread(target=loop, args=(r,), name=f"rank{r.rank}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
    assert not any(t.is_alive() for t in threads), "a training loop did not end in time"
    for r in ranks:
        if r.error is not None:
            raise AssertionError(f"rank {r.rank}'s loop failed") from r.error


def rank_states(client: httpx.Client, job: str) -> dict[int, dict[str, Any]]:
    resp = client.get(f"/v1/jobs/{job}/ranks")
    assert resp.status_code == 200, resp.text
    return {r["rank"]: r for r in resp.json()["ranks"]}


def events(client: httpx.Client, job: str) -> list[dict[str, Any]]:
    resp = client.get(f"/v1/jobs/{job}/events")
    assert resp.status_code == 200, resp.text
    found: list[dict[str, Any]] = resp.json()["events"]
    return found


def wait_until(check: Callable[[], bool], timeout: float, every: float = 0.02) -> float:
    """Seconds until ``check()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(every)
    return time.monotonic() - t0


# -- 1. a coordinated snapshot ---------------------------------------------------------


@pytest.mark.slow
def test_ecc_errors_on_one_rank_snapshot_every_rank_at_one_target(
    client: httpx.Client, ranks_of: Callable[..., list[Rank]]
) -> None:
    job = "health-ecc"
    ranks = ranks_of(job)
    bad = ranks[2]

    def loop(r: Rank) -> None:
        def hook(step: int) -> bool:
            # Before step 4: this rank has noted step 3, and its request beats
            # that to the server first, so the target is at least 3 + LEAD. (The
            # probe reads on its own thread and may ask before step 4 is noted.)
            if r is bad and step == 4:
                r.source.push({ECC: 2})  # degraded from 1, critical from 10
            return False

        train(r, 14, deadline=time.monotonic() + 15, hook=hook)

    run_ranks(ranks, loop, limit=20)

    saved = {r.rank: r.saved for r in ranks}
    targets = {steps[0][0] for steps in saved.values() if steps}
    assert all(len(steps) == 1 for steps in saved.values()), saved
    assert len(targets) == 1, saved
    target = targets.pop()
    assert 3 + LEAD <= target <= 14
    for r in ranks:
        assert r.saved == [(target, {"reason": "health", "requested_by": 2})]
        assert [s for s, d in r.decisions if d.snapshot] == [target]

    resp = client.get(f"/v1/jobs/{job}/steps/{target}")
    assert resp.status_code == 200, resp.text
    record = resp.json()
    assert record["meta"] == {"reason": "health", "requested_by": 2}
    assert record["world_size"] == WORLD
    kinds = [(e["kind"], e["rank"], e["step"]) for e in events(client, job)]
    assert ("snapshot_requested", 2, target) in kinds
    assert any(k == "snapshot_committed" and s == target for k, _, s in kinds), kinds
    # The server heard why: rank 2 is degraded, the others are not.
    states = rank_states(client, job)
    assert states[2]["state"] == "degraded"
    assert any("ECC" in reason for reason in states[2]["health"]["reasons"])
    assert {states[r]["state"] for r in (0, 1, 3)} == {"alive"}
    assert client.get(f"/v1/jobs/{job}/ranks").json()["snapshot_at"] is None


# -- 2. a non-finite loss -------------------------------------------------------------


@pytest.mark.slow
def test_nan_loss_on_one_rank_rolls_every_rank_back_to_the_last_commit(
    client: httpx.Client, ranks_of: Callable[..., list[Rank]]
) -> None:
    job = "health-nan"
    ranks = ranks_of(job)
    bad_step = 10
    poisoned = threading.Event()

    def loop(r: Rank) -> None:
        def loss_at(step: int) -> float:
            if r.rank == 1 and step == bad_step and not poisoned.is_set():
                poisoned.set()
                return math.nan
            return 1.0 / step

        train(r, 16, deadline=time.monotonic() + 15, every=4, loss_at=loss_at,
              after_rollback=3)

    run_ranks(ranks, loop, limit=20)

    assert poisoned.is_set()
    for r in ranks:
        assert len(r.rollbacks) == 1, (r.rank, r.rollbacks)  # raised once, not forever
        at, exc = r.rollbacks[0]
        assert exc.rollback_to == 8 and exc.code == "rollback_requested"
        assert r.restored == [8]
        if r.rank == 1:
            assert (at, exc.step) == (bad_step, bad_step)  # at once, in that step() call
        else:
            assert exc.step is None and at > bad_step - 2  # from a heartbeat reply
        # Every step after the restore ran (9 .. 11), with no further rollback.
        assert [s for s, _ in r.decisions if s > 8][-3:] == [9, 10, 11]
        assert not any(d.snapshot for _, d in r.decisions)
        assert bad_step not in [s for s, _ in r.saved]

    steps = client.get(f"/v1/jobs/{job}/steps").json()["steps"]
    assert bad_step not in [s["step"] for s in steps]  # no manifest of the poisoned step
    assert client.get(f"/v1/jobs/{job}/latest").json()["step"] == 8
    listing = client.get(f"/v1/jobs/{job}/ranks").json()
    assert listing["rollback_to"] == 8
    rollback_events = [e for e in events(client, job) if e["kind"] == "rollback_set"]
    assert [e["step"] for e in rollback_events] == [8]
    assert "rank 1" in rollback_events[0]["reason"]


@pytest.mark.slow
def test_a_second_rollback_to_the_same_step_is_told_to_every_rank(
    client: httpx.Client, ranks_of: Callable[..., list[Rank]]
) -> None:
    """A loss goes NaN on rank 1; every rank rolls back to step 4. On the way again
    the loss goes NaN on rank 2 before anything new commits: the marker names step
    4 again, in a new timeline, and every rank must roll back a second time."""
    job = "health-nan-twice"
    ranks = ranks_of(job)
    first, second = threading.Event(), threading.Event()

    def loop(r: Rank) -> None:
        def loss_at(step: int) -> float:
            if r.rank == 1 and step == 6 and not first.is_set():
                first.set()
                return math.nan
            if r.rank == 2 and step == 6 and first.is_set() and r.restored and \
                    not second.is_set():
                second.set()
                return math.nan
            return 1.0 / step

        train(r, 12, deadline=time.monotonic() + 20, every=4, loss_at=loss_at,
              after_rollback=4)

    run_ranks(ranks, loop, limit=25)

    assert first.is_set() and second.is_set()
    for r in ranks:
        assert r.restored == [4, 4], (r.rank, r.rollbacks)
        assert r.ckpt.epoch == 2
    rollback_events = [e for e in events(client, job) if e["kind"] == "rollback_set"]
    assert [e["step"] for e in rollback_events] == [4, 4]
    assert client.get(f"/v1/jobs/{job}/rollback").json()["epoch"] == 2
    # The step-8 snapshot taken after the second rollback committed, in timeline 2.
    record = client.get(f"/v1/jobs/{job}/steps/8").json()
    assert record["world_size"] == WORLD


# -- 3. a stalled rank ------------------------------------------------------------------


STALL_S = 0.6
STALL_POLICY = QUIET + f"""
[signals.seconds_since_step]
degraded = {STALL_S}
critical = "off"
"""
STALL_POLICY = STALL_POLICY.replace(
    "[actions]\n", "[actions]\ndegraded = []   # this test watches the report only\n"
)


def test_a_stalled_rank_is_reported_degraded_within_the_stall_time(
    client: httpx.Client, ranks_of: Callable[..., list[Rank]]
) -> None:
    job = "health-stall"
    ranks = ranks_of(job, STALL_POLICY)
    resume = threading.Event()
    stalled = threading.Event()
    stop = threading.Event()

    def loop(r: Rank) -> None:
        def hook(step: int) -> bool:
            if r.rank == 2 and step == 5 and not resume.is_set():
                stalled.set()
                resume.wait(10)  # the loop stops calling step() ...
            return stop.is_set()  # ... and then goes on

        train(r, 60, deadline=time.monotonic() + 15, hook=hook)

    threads = [threading.Thread(target=loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    try:
        assert stalled.wait(10)
        last_step = ranks[2].last_step_at
        wait_until(lambda: rank_states(client, job)[2]["state"] == "degraded", timeout=5)
        seen = time.monotonic() - last_step
        # Not before the threshold; after it, within one probe interval plus one
        # heartbeat (and slack for a loaded machine).
        assert STALL_S <= seen <= STALL_S + 0.05 + INTERVAL + 1.0, seen
        states = rank_states(client, job)
        assert any("no step for" in reason for reason in states[2]["health"]["reasons"]), states[2]
        assert {states[r]["state"] for r in (0, 1, 3)} == {"alive"}
        resume.set()
        wait_until(lambda: rank_states(client, job)[2]["state"] == "alive", timeout=5)
    finally:
        resume.set()
        stop.set()
        for t in threads:
            t.join(20)
    assert not any(t.is_alive() for t in threads)


# -- 4. a dead rank ---------------------------------------------------------------------


def test_a_rank_whose_heartbeats_stop_is_dead_after_the_missed_intervals(
    client: httpx.Client, ranks_of: Callable[..., list[Rank]]
) -> None:
    job = "health-dead"
    ranks = ranks_of(job)
    stop = threading.Event()
    killed = threading.Event()

    def loop(r: Rank) -> None:
        def hook(step: int) -> bool:
            return stop.is_set() or (r.rank == 3 and killed.is_set())

        train(r, 60, deadline=time.monotonic() + 15, hook=hook)

    threads = [threading.Thread(target=loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(rank_states(client, job)) == WORLD
                   and all(s["state"] == "alive" for s in rank_states(client, job).values()),
                   timeout=5)
        # The rank is killed: its loop ends, its agent closes and the heartbeats
        # (its checkpointer's, which the agent shares) stop, with no goodbye.
        killed.set()
        ranks[3].agent.close()
        heartbeat = ranks[3].ckpt.heartbeat
        assert heartbeat is not None
        heartbeat.stop()
        closed = time.monotonic()
        wait_until(lambda: rank_states(client, job)[3]["state"] == "dead", timeout=5)
        seen = time.monotonic() - closed
        window = INTERVAL * DEAD_AFTER
        # Its last heartbeat went at most one interval before the close.
        assert window - INTERVAL - 0.05 <= seen <= window + 1.0, seen
        states = rank_states(client, job)
        assert {states[r]["state"] for r in (0, 1, 2)} == {"alive"}
        dead = [e for e in events(client, job) if e["kind"] == "rank_dead"]
        assert [e["rank"] for e in dead] == [3]
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    assert not any(t.is_alive() for t in threads)


def test_an_agent_without_a_shared_heartbeat_sends_its_own_and_stops_it_on_close(
    srv: ServerProcess, client: httpx.Client
) -> None:
    job = "health-own-heartbeat"
    source = ScriptedSource([{ECC: 0}])
    agent = HealthAgent(srv.url, job, 0, 1, srv.token, sources=[source]).start()
    try:
        agent.step(1, 0.5)
        wait_until(lambda: rank_states(client, job).get(0, {}).get("step") == 1, timeout=5)
        source.push({ECC: 20})  # critical: report_failing sends a heartbeat at once
        agent.probe.evaluate_now()
        wait_until(lambda: rank_states(client, job)[0]["state"] == "critical", timeout=5)
        assert agent.failing is not None and "ECC" in agent.failing
    finally:
        agent.close()
    closed = time.monotonic()
    wait_until(lambda: rank_states(client, job)[0]["state"] == "dead", timeout=5)
    assert time.monotonic() - closed <= INTERVAL * DEAD_AFTER + 1.0


def test_with_a_file_store_the_probe_runs_without_coordination(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"file://{tmp_path / 'store'}"
    source = ScriptedSource([{ECC: 0}])
    with Checkpointer(url, "health-file", shm_dir=shm) as ckpt:
        assert ckpt.heartbeat is None
        with caplog.at_level(logging.INFO, logger="ckptd.client.health"):
            agent = HealthAgent(url, "health-file", 0, 1, sources=[source],
                                latest=ckpt.latest).start()
        try:
            assert "no heartbeats, coordinated snapshots or rollback markers" in caplog.text
            assert agent.step(1, 1.0) == StepDecision()
            ckpt.save(1, state_at(1), meta={"reason": "periodic"}).wait(20)
            source.push({ECC: 2})
            agent.probe.evaluate_now()  # degraded: one rank needs no coordination
            decision = agent.step(2, 0.5)
            assert decision.snapshot and decision.meta == {"reason": "health",
                                                           "requested_by": 0}
            assert not agent.step(3, 0.4).snapshot
            with pytest.raises(RollbackRequested) as raised:
                agent.step(4, math.inf)
            assert (raised.value.step, raised.value.rollback_to) == (4, 1)
            assert agent.rollback_to == 1
            assert not agent.step(5, math.nan).snapshot  # told once; still poisoned
            agent.acknowledge_rollback(1)
            assert agent.rollback_to is None
            assert agent.status().signals["loss_nonfinite"] == 0
        finally:
            agent.close()


def test_the_time_a_save_holds_the_loop_is_not_the_steps(tmp_path: Path, shm: Path) -> None:
    """The README's loop: save() then step(). A save holds the loop for its copy, and
    for the upload of the save before it when that is not done (a slow store): here
    two saves in a row, the second waiting out the first's 256 MiB. The probe times
    each step without that wait, so a slow save does not make a step "3x the
    median" (which asked for one more snapshot each time the store was slow)."""
    from ckptd.client.health.policy_file import parse_policy

    policy = parse_policy("[probe]\nstep_window = 10\nstep_min_samples = 3\n"
                          "[signals.step_time_ratio]\ndegraded = 3.0\n")
    state = {"w": torch.randn(64 << 20)}
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "held", shm_dir=shm, health_policy=policy,
                      health_sources=[]) as ckpt:
        held: dict[int, tuple[float, float, float | None]] = {}
        for step in range(10):
            began = time.monotonic()
            time.sleep(0.005)  # the step's own work
            waited = 0.0
            if step in (6, 7):
                t0 = time.monotonic()
                ckpt.save(step, state)
                waited = time.monotonic() - t0
            took = time.monotonic() - began
            assert ckpt.step(step, loss=1.0) is None  # no snapshot asked
            timed = ckpt._health_agent().probe.evaluate_now().signals["step_time_s"]
            if waited:
                held[step] = (took, waited, timed)
    took, waited, _ = held[7]
    assert waited >= 0.05, held  # the second save waited for the first's upload
    for took, waited, timed in held.values():
        assert timed is not None and timed <= took - waited + 0.025, held
