"""The lifecycle through a real ``ckptd serve``: housekeeping at start, retention
after commits, tags, forget/gc/scrub/space from the CLI, metrics, restore of
latest skipping a damaged step, and store_full before the disk is full."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.format import chunk_key
from ckptd.hashing import chunk_id
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess
from tests.relay import relay

JOB = "job"
runner = CliRunner()


async def _fill(root: Path, steps: range, *, commit: bool = True) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    for step in steps:
        for manifest, chunks in demo_step(JOB, step, 2):
            await put_rank(repo, manifest, chunks)
        if commit:
            assert (await repo.commit(JOB, step)).state == "committed"
    await repo.put_chunk(chunk_id(b"orphan"), b"orphan")


def _cli(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow
def test_lifecycle_through_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    asyncio.run(_fill(root, range(1, 6)))
    asyncio.run(_fill(root, range(6, 7), commit=False))  # pending: committed over HTTP
    stale = root / "chunks" / ".tmp-0123456789abcdef0123456789abcdef"
    stale.write_bytes(b"left by a killed server")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    policy = tmp_path / "retention.toml"
    policy.write_text("[retention]\nkeep_last = 2\n")
    # Directly on the store (no server yet): tag, and a dry run of the policy.
    _cli("tag", JOB, "2", "eval-best", "--url", str(root))
    out = _cli("forget", JOB, "--dry-run", "--retention", str(policy), "--url", str(root))
    assert "would forget 2 steps of job: [1, 3]" in out and "tagged eval-best" in out
    srv = ServerProcess(store=root, extra_args=["--retention", str(policy), "--gc-grace", "0"])
    srv.start()
    try:
        assert not stale.exists()  # housekeeping at start
        url = srv.url
        # A commit over HTTP: retention runs after it (keep_last 2 and the tag).
        r = httpx.post(f"{url}/v1/jobs/{JOB}/steps/6/commit", json={}, timeout=10)
        assert r.json()["state"] == "committed"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = httpx.get(f"{url}/v1/jobs/{JOB}/steps", timeout=10)
            steps = [s["step"] for s in r.json()["steps"]] if r.status_code == 200 else None
            if steps == [2, 5, 6]:
                break
            time.sleep(0.2)
        assert steps == [2, 5, 6], (r.status_code, r.text[:500])
        dry = _cli("gc", "--dry-run", "--url", url)
        assert f"would delete chunk {chunk_id(b'orphan')}" in dry
        out = _cli("gc", "--url", url)
        assert "freed" in out and "kept" in out
        assert not (root / chunk_key(chunk_id(b"orphan"))).exists()
        space = _cli("space", "--url", url)
        assert JOB in space and "space left" in space
        metrics = httpx.get(f"{url}/metrics").text
        assert 'ckptd_job_stored_bytes{job="job"}' in metrics
        # Corrupt a chunk only step 6 names: scrub marks it, latest skips it.
        manifest = demo_step(JOB, 6, 2)[0][0]
        victim = root / chunk_key(manifest.entries[0].chunks[0])
        victim.write_bytes(b"\0" + victim.read_bytes()[1:])
        result = runner.invoke(app, ["scrub", "--url", url])
        assert result.exit_code == 1 and "damaged" in result.output, result.output
        assert httpx.get(f"{url}/v1/jobs/{JOB}/latest").json()["step"] == 5
        assert httpx.get(f"{url}/v1/jobs/{JOB}/damage").json() == {
            "6": [manifest.entries[0].chunks[0]]}
        listed = runner.invoke(app, ["ls", JOB, "--url", url])  # (damage listed: exit 1)
        assert listed.exit_code == 1 and "damaged" in listed.output, listed.output
        overview = httpx.get(f"{url}/v1/overview").json()
        assert [s["step"] for s in overview["jobs"][0]["steps"] if s.get("damaged")] == [6]
        assert "damaged steps [6]" in _cli("status", "--url", url)
        _cli("untag", JOB, "eval-best", "--url", url)
        # Nearly full: new snapshots are refused before a byte is sent.
        monkeypatch.setenv("CKPTD_MIN_FREE_BYTES", str(1 << 62))
        srv.restart()
        r = httpx.post(f"{srv.url}/v1/chunks/missing",
                       json={"ids": [chunk_id(b"new")], "claimer": "r0"}, timeout=10)
        assert r.status_code == 507 and r.json()["code"] == "store_full"
    finally:
        srv.stop()


@pytest.fixture
def one_step(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server over a store of one committed step and one orphan chunk."""
    root = tmp_path / "store"
    asyncio.run(_fill(root, range(1, 2)))
    srv = ServerProcess(store=root)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_gc_through_the_server_outlasts_the_clients_read_timeout(one_step: ServerProcess
                                                                 ) -> None:
    """A collection waits out its grace period before it sweeps: the CLI follows it
    past its ordinary 10 s read timeout while the server is still collecting."""
    started = time.monotonic()
    out = _cli("gc", "--grace", "11", "--url", one_step.url)
    assert time.monotonic() - started >= 11
    assert "freed" in out and "1 chunks" in out, out


def test_a_poll_that_does_not_get_through_is_asked_again(one_step: ServerProcess) -> None:
    """The CLI's calls are not retried: a poll whose connection was reset (the
    replica running the collection killed under it, found in a full run) ended the
    command with "cannot reach ..." while the next replica would have answered."""
    started: list[str] = []

    def drop(method: str, path: str) -> bool:
        if method == "POST" and path.startswith("/v1/gc/runs"):
            started.append(path)
        elif method == "GET" and path.startswith("/v1/gc") and len(started) == 1:
            started.append(path)  # (the first poll after the run started: dropped)
            return True
        return False

    with relay(one_step.url, drop=drop) as front:
        out = _cli("gc", "--grace", "1", "--url", front)
    assert len(started) == 2 and "freed" in out, (started, out)


def test_a_background_collection_answers_at_once_and_is_followed(one_step: ServerProcess
                                                                  ) -> None:
    """POST /v1/gc/runs answers before the grace period ends (no request lasts it,
    so no proxy's read timeout cuts one), one at a time; GET /v1/gc shows it
    running, then its report."""
    srv = one_step
    started = time.monotonic()
    r = httpx.post(f"{srv.url}/v1/gc/runs", params={"grace": 3}, timeout=10)
    assert r.status_code == 202 and time.monotonic() - started < 2.5, r.text
    run = r.json()
    assert run["grace"] == 3 and run["ended_at"] is None
    again = httpx.post(f"{srv.url}/v1/gc/runs", params={"grace": 3}, timeout=10).json()
    assert again["id"] == run["id"]  # one at a time: the running one
    status = httpx.get(f"{srv.url}/v1/gc", timeout=10).json()
    assert status["running"]["id"] == run["id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = httpx.get(f"{srv.url}/v1/gc", timeout=10).json()
        if status["running"] is None:
            break
        time.sleep(0.2)
    assert status["running"] is None and status["last_run"]["id"] == run["id"]
    report = status["last_run"]["report"]
    assert status["last_run"]["error"] is None and report["chunks_deleted"] == 1
    assert status["last_run"]["ended_at"] - run["started_at"] >= 3


@pytest.mark.parametrize("grace", ["inf", "1e308", "604801", "nan"])
def test_a_grace_period_no_collection_can_wait_out_is_refused(
        one_step: ServerProcess, tmp_path: Path, grace: str) -> None:
    """(found by a probe: grace=inf started a run that held the GC lease in
    'marking' until a restart, every later collection 503 gc_in_progress)"""
    srv = one_step
    for path in ("/v1/gc/runs", "/v1/gc"):
        r = httpx.post(f"{srv.url}{path}", params={"grace": grace}, timeout=10)
        assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text
        assert grace == "nan" or "7 days" in r.json()["message"], r.text
    status = httpx.get(f"{srv.url}/v1/gc", timeout=10).json()
    assert status["running"] is None and status["state"]["phase"] == "idle", status
    result = runner.invoke(app, ["gc", "--grace", grace, "--url", srv.url])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    result = runner.invoke(app, ["gc", "--grace", grace, "--url", str(tmp_path / "store")])
    assert result.exit_code != 0 and (grace == "nan" or "7 days" in result.output), \
        result.output
    r = httpx.post(f"{srv.url}/v1/gc", params={"grace": 0}, timeout=30)  # no lease held
    assert r.status_code == 200 and r.json()["chunks_deleted"] == 1, r.text


def test_a_tag_moved_to_another_step_says_from_which(tmp_path: Path) -> None:
    """(found by a probe: a tag on step 1 moved to step 2 said only "tagged step 2")"""
    root = tmp_path / "store"
    asyncio.run(_fill(root, range(1, 3)))
    assert "->" not in _cli("tag", JOB, "1", "best", "--url", str(root))
    out = _cli("tag", JOB, "2", "best", "--url", str(root))  # directly on the store
    assert "moved" in out and "step 1 -> step 2" in out, out
    assert "->" not in _cli("tag", JOB, "2", "best", "--url", str(root))  # where it was
    srv = ServerProcess(store=root)
    srv.start()
    try:
        out = _cli("tag", JOB, "1", "best", "--url", srv.url)  # through a server
        assert "moved" in out and "step 2 -> step 1" in out, out
    finally:
        srv.stop()


@pytest.mark.parametrize("name", ["latest", "rollback"])
def test_a_tag_named_as_a_ref_is_refused_by_the_server(tmp_path: Path, name: str) -> None:
    """(found by a probe: tags "latest" and "rollback" were kept, beside the refs of
    those names.) The server refuses them, so every client is told: the route, the
    CLI through it, and a store read directly; a commit asking for one commits its
    step untagged."""
    root = tmp_path / "store"
    asyncio.run(_fill(root, range(1, 2)))
    refused = runner.invoke(app, ["tag", JOB, "1", name, "--url", str(root)])
    assert refused.exit_code != 0 and "reserved" in refused.output, refused.output
    srv = ServerProcess(store=root)
    srv.start()
    try:
        r = httpx.put(f"{srv.url}/v1/jobs/{JOB}/tags/{name}", json={"step": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["code"] == "invalid_name", r.text
        message = r.json()["message"]
        assert "reserved" in message and "another name" in message and "\n" not in message
        # A commit asking for it (a client from before the names were reserved): the
        # step commits, untagged (refused, it failed on every retry; found by review).
        r = httpx.post(f"{srv.url}/v1/jobs/{JOB}/steps/1/commit",
                       json={"meta": {"tag": name}}, timeout=30)
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text
        assert "tag" not in r.json()["record"]["meta"], r.text
        refused = runner.invoke(app, ["tag", JOB, "1", name, "--url", srv.url])
        assert refused.exit_code != 0 and "another name" in refused.output, refused.output
        assert "Traceback" not in refused.output
        assert httpx.get(f"{srv.url}/v1/jobs/{JOB}/tags", timeout=30).json() == {}
        assert _cli("tag", JOB, "1", f"{name}-1", "--url", srv.url)  # (a name like it is fine)
    finally:
        srv.stop()

def test_a_damaged_latest_step_that_stops_gc_is_forgotten_as_gc_says(tmp_path: Path) -> None:
    """(found by a probe: gc said 'forget that step' of a damaged manifest of the
    latest step, but forget never forgets latest)"""
    root = tmp_path / "store"

    async def fill() -> None:
        repo = Repository(LocalStore(root, fsync=False))
        for job in ("d1", "d2"):
            for step in (1, 2, 3):
                for manifest, chunks in demo_step(job, step, 2, seed=job):
                    await put_rank(repo, manifest, chunks)
                assert (await repo.commit(job, step)).state == "committed"

    asyncio.run(fill())
    for job in ("d1", "d2"):
        man = root / "jobs" / job / "steps" / "3" / "ranks" / "0.json"
        man.write_bytes(man.read_bytes()[:100])
    srv = ServerProcess(store=root)
    srv.start()
    try:
        r = httpx.post(f"{srv.url}/v1/gc", params={"grace": 0}, timeout=30)
        assert r.status_code == 500 and r.json()["code"] == "store_corrupt", r.text
        assert "ckptd forget d" in r.json()["message"] and "--step 3" in r.json()["message"]
        out = _cli("forget", "d1", "--keep-last", "1", "--url", srv.url)
        assert "forgot 2 steps" in out and "[1, 2]" in out, out  # latest (3) is kept
        result = runner.invoke(app, ["forget", "d2", "--step", "2", "--url", srv.url])
        assert result.exit_code != 0 and "intact" in result.output, result.output
        out = _cli("forget", "d1", "--step", "3", "--url", srv.url)
        assert "forgot 1 step of" in out and "[3]" in out, out  # (it said "1 steps")
        out = _cli("forget", "d2", "--step", "3", "--url", str(root))  # on the store
        assert "forgot 1 step of" in out and "[3]" in out, out  # (it said "1 steps")
        r = httpx.get(f"{srv.url}/v1/jobs/d1/latest", timeout=10)
        assert r.status_code == 404, r.text  # d1 kept no intact step: nothing to restore
        r = httpx.get(f"{srv.url}/v1/jobs/d2/latest", timeout=10)
        assert r.status_code == 200 and r.json()["step"] == 2, r.text
        assert not r.json().get("problems"), r.text
        r = httpx.get(f"{srv.url}/v1/jobs/d2/restore-plan", params={"rank": 0}, timeout=10)
        assert r.status_code == 200 and r.json()["step"] == 2, r.text
        r = httpx.post(f"{srv.url}/v1/gc", params={"grace": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["chunks_deleted"] > 0, r.text
    finally:
        srv.stop()


def _census_workers(srv: ServerProcess) -> list[psutil.Process]:
    assert srv.proc is not None
    return [p for p in psutil.Process(srv.proc.pid).children()
            if "ckptd.lifecycle.census_worker" in p.cmdline()]


def _space_when_complete(srv: ServerProcess) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        body: dict[str, Any] = httpx.get(f"{srv.url}/v1/space", timeout=10).json()
        if body["complete"] or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_a_server_over_an_empty_store_starts_its_census_worker_at_the_first_commit(
        server: ServerProcess) -> None:
    """(Every server start spawned the census's worker process, about 0.2 CPU-s, the
    test suite's ~300 starts included.) Over an empty store the census answers
    without one; the first commit starts it, and GET /v1/space counts the step."""
    empty = _space_when_complete(server)
    assert empty["complete"] and empty["jobs"] == [] and empty["chunks"] == 0, empty
    assert _census_workers(server) == []

    async def upload() -> None:
        repo = Repository(LocalStore(Path(server.store), fsync=False))
        for manifest, chunks in demo_step(JOB, 1, 2):
            await put_rank(repo, manifest, chunks)

    asyncio.run(upload())
    r = httpx.post(f"{server.url}/v1/jobs/{JOB}/steps/1/commit", json={}, timeout=10)
    assert r.json()["state"] == "committed", r.text
    space = _space_when_complete(server)
    assert space["complete"] and [j["job"] for j in space["jobs"]] == [JOB], space
    assert [s["step"] for s in space["jobs"][0]["steps"]] == [1]
    assert space["jobs"][0]["stored_bytes"] > 0 and space["chunks"] > 0, space
    assert len(_census_workers(server)) == 1
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'ckptd_job_stored_bytes{{job="{JOB}"}}' in metrics
