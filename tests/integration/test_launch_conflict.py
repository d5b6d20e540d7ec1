"""Two jobs with one name (docs/failover.md): ranks of two launches of one job that
beat at the same time are told so in their heartbeat replies, the server logs it
once and records a ``launch_conflict`` event; a restart (the old launch's ranks
silent, not yet dead) is no conflict. And a refused peer URL is logged once per
rank, not per heartbeat, with the right advice for a loopback one. A real
``ckptd serve`` and the client's own heartbeats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.client import Checkpointer
from ckptd.client.health.heartbeat import Heartbeat
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)

INTERVAL = 0.2
DEAD_AFTER = 5  # dead 1 s after the last heartbeat: a restart below comes well within it
CLIENT_LOG = "ckptd.client.health.heartbeat"
SAID = "has live ranks of two launches at once"


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(store=tmp_path / "store", extra_args=[
        "--heartbeat-interval", str(INTERVAL), "--dead-after", str(DEAD_AFTER)])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def events(url: str, job: str, kind: str) -> list[dict[str, Any]]:
    doc: dict[str, Any] = httpx.get(f"{url}/v1/jobs/{job}/events", timeout=5).json()
    return [e for e in doc["events"] if e["kind"] == kind]


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def beats(url: str, job: str, launch: str, world: int = 2) -> list[Heartbeat]:
    return [Heartbeat(url, job, rank, world, interval=0.1, launch=launch)
            for rank in range(world)]


def test_two_jobs_with_one_name_are_told_on_both_sides(
        srv: ServerProcess, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Two training jobs, each its own launch (the environment names it, as torchrun's
    # or SLURM's does), both told job=llm-7b: the probe's collision.
    caplog.set_level(logging.WARNING, logger=CLIENT_LOG)
    job = "llm-7b"
    ckpts: dict[str, list[Checkpointer]] = {}
    try:
        for launch in ("job-x", "job-y"):
            monkeypatch.setenv("CKPTD_INCARNATION", launch)
            ckpts[launch] = [Checkpointer(srv.url, job, rank=r, world_size=2,
                                          heartbeat_interval=0.1, serve_peers=False)
                             for r in range(2)]
        every = [c for cs in ckpts.values() for c in cs]

        def told(c: Checkpointer) -> bool:
            reply = c.last_heartbeat_reply
            return reply is not None and reply.launch_conflict is not None

        # (what each was told, kept as it comes: on a loaded machine a late beat may
        # let one reply in between go without it)
        seen: dict[int, str] = {}

        def all_told() -> bool:
            for c in every:
                if told(c):
                    seen.setdefault(id(c), c.last_heartbeat_reply.launch_conflict)  # type: ignore[union-attr]
            return len(seen) == len(every)

        wait_for(all_told)
        time.sleep(1.0)  # ten beats more: still one line per rank, one on the server
        for text in seen.values():
            assert f"job {job} {SAID}" in text
            assert "127.0.0.1" in text and "ranks 0" in text  # (0-1 once both beat)
            assert "another job name" in text
        said = [r for r in caplog.records if SAID in r.getMessage()]
        assert len(said) == 4, [r.getMessage() for r in said]
        assert all(r.levelno == logging.WARNING and job in r.getMessage() for r in said)
        assert srv.log().count(SAID) == 1, srv.log()
        found = events(srv.url, job, "launch_conflict")
        assert len(found) == 1 and "job-x" in found[0]["reason"] and "job-y" in found[0][
            "reason"], found

        # Job y goes away: job x's replies say no more of it.
        for c in ckpts.pop("job-y"):
            c.close()
        wait_for(lambda: all(not told(c) for c in ckpts["job-x"]))
    finally:
        for cs in ckpts.values():
            for c in cs:
                c.close()


def test_launches_named_by_incarnation_are_told_apart(
        srv: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Checkpointer(incarnation=...)`` names the launch where nothing in the
    environment does (a launcher of one's own): its heartbeats carried the
    environment's launch instead, none here, and two jobs with one name went untold."""
    monkeypatch.delenv("CKPTD_INCARNATION", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    ckpts = [Checkpointer(srv.url, "named", rank=0, world_size=2, incarnation=launch,
                          heartbeat_interval=0.1, serve_peers=False)
             for launch in ("run-a", "run-b")]
    try:
        def told() -> bool:
            return all(c.last_heartbeat_reply is not None
                       and c.last_heartbeat_reply.launch_conflict is not None for c in ckpts)

        wait_for(told)
        found = events(srv.url, "named", "launch_conflict")
        assert len(found) == 1 and "run-a" in found[0]["reason"] and "run-b" in found[0][
            "reason"], found
    finally:
        for c in ckpts:
            c.close()


def test_a_restart_is_no_conflict_but_an_old_rank_still_beating_is(
        srv: ServerProcess) -> None:
    job = "restarted"
    old = beats(srv.url, job, "launch-1")
    for hb in old:
        hb.beat_now()
    for hb in old:
        hb.stop()  # killed by torchrun: silent, and not yet dead on the server
    new = beats(srv.url, job, "launch-2")
    try:
        for _ in range(8):  # within the dead window of the old launch's ranks
            for hb in new:
                reply = hb.beat_now()
                assert reply is not None and reply.launch_conflict is None, reply
            time.sleep(0.1)
        doc = httpx.get(f"{srv.url}/v1/jobs/{job}/ranks", timeout=5).json()
        assert {r["state"] for r in doc["ranks"]} == {"alive"}
        assert events(srv.url, job, "launch_conflict") == []
        assert SAID not in srv.log()

        # A rank of the old launch comes back (its link was cut) and beats on: both
        # sides are told, as for two jobs.
        zombie = Heartbeat(srv.url, job, 1, 2, interval=0.1, launch="launch-1")
        try:
            reply = None
            for _ in range(3):
                reply = zombie.beat_now()
                for hb in new:
                    hb.beat_now()
                time.sleep(0.05)
            assert reply is not None and reply.launch_conflict is not None
            assert "launch-2" in reply.launch_conflict and "ranks 0-1" in reply.launch_conflict
            mine = new[0].last_reply
            assert mine is not None and mine.launch_conflict is not None
            assert "launch-1" in mine.launch_conflict and "ranks 1" in mine.launch_conflict
            assert len(events(srv.url, job, "launch_conflict")) == 1
        finally:
            zombie.stop()
    finally:
        for hb in new:
            hb.stop()


def test_another_world_size_is_refused_and_named_as_two_launches(srv: ServerProcess) -> None:
    job = "sizes"
    x = beats(srv.url, job, "job-x", world=2)
    y = Heartbeat(srv.url, job, 0, 4, interval=0.1, launch="job-y")
    try:
        for hb in x:
            assert hb.beat_now() is not None
        for _ in range(3):
            assert y.beat_now() is None  # world_size_mismatch, as before
            for hb in x:
                hb.beat_now()
            time.sleep(0.05)
        reply = x[0].last_reply
        assert reply is not None and reply.launch_conflict is not None
        assert "job-y" in reply.launch_conflict and "ranks 0" in reply.launch_conflict
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            r = client.post(f"/v1/jobs/{job}/ranks/0/heartbeat",
                            json={"world_size": 4, "launch": "job-y"})
        assert r.status_code == 409 and r.json()["code"] == "world_size_mismatch"
        assert SAID in r.json()["message"] and "job-x" in r.json()["message"]
    finally:
        y.stop()
        for hb in x:
            hb.stop()


def test_beats_without_a_launch_are_as_before(srv: ServerProcess) -> None:
    with httpx.Client(base_url=srv.url, timeout=5) as client:
        for rank in (0, 1, 0, 1):
            r = client.post(f"/v1/jobs/old/ranks/{rank}/heartbeat", json={"world_size": 2})
            assert r.status_code == 200 and r.json()["launch_conflict"] is None
        r = client.post("/v1/jobs/old/ranks/0/heartbeat",
                        json={"world_size": 2, "launch": ""})
        assert r.status_code == 400, r.text
        # (it goes into the server's log: a line break there would forge lines)
        r = client.post("/v1/jobs/old/ranks/0/heartbeat",
                        json={"world_size": 2, "launch": "x\n2026 WARNING forged"})
        assert r.status_code == 400, r.text


def test_a_refused_loopback_peer_url_is_said_once_with_what_to_do(
        srv: ServerProcess, caplog: pytest.LogCaptureFixture) -> None:
    # A rank whose peer server listens on 127.0.0.2 only (CKPTD_PEER_HOST) beats from
    # 127.0.0.1: not its source address, so the server does not register it.
    caplog.set_level(logging.WARNING, logger=CLIENT_LOG)
    hb = Heartbeat(srv.url, "peers", 0, 1, interval=0.1, peer_url="http://127.0.0.2:9/")
    try:
        for _ in range(20):
            reply = hb.beat_now()
            assert reply is not None and reply.peer_url_refused is not None
    finally:
        hb.stop()
    assert srv.log().count("not registered") == 1, srv.log()
    said = [r.getMessage() for r in caplog.records if "peer URL" in r.getMessage()]
    assert len(said) == 1, said
    assert "listens on loopback only" in said[0] and "CKPTD_PEER_HOST" in said[0]
    # (the server's networks would hand a loopback URL to other hosts)
    assert "CKPTD_PEER_NETWORKS on the server" not in said[0]
