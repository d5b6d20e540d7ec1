"""Issue 20, item 3: a document of a newer format damages one job's listing, not all.

``"version": 99`` in one job's ``refs/latest``, and in another job's commit
record: every listing (``GET /v1/jobs``, a job's steps, ``GET /v1/overview``,
``ckptd ls`` over the server and over the store directory) shows that job or
step as unsupported (not damaged), says to upgrade, and keeps every other job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from tests.conftest import ServerProcess


def _newer(path: Path) -> None:
    doc = json.loads(path.read_bytes())
    doc["version"] = 99
    path.write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def newer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Jobs ``good`` (step 1), ``newref`` (step 1, a version 99 latest ref) and
    ``newcommit`` (steps 1 and 2, step 2's commit record of version 99)."""
    srv = ServerProcess(store=tmp_path_factory.mktemp("newer") / "store")
    srv.start()
    try:
        for job, steps in (("good", [1]), ("newref", [1]), ("newcommit", [1, 2])):
            with Checkpointer(srv.url, job, chunk_size=4096, serve_peers=False,
                              heartbeat_interval=0) as ckpt:
                for step in steps:
                    state = {"w": torch.full((32, 32), float(step))}
                    assert ckpt.save(step, state).wait(timeout=60).state == "committed"
        # Written while no server runs, as a newer ckptd sharing the store would have
        # left them: a running server's census counts a step when it commits and sees
        # a record replaced under it only at a later full pass (it is a hint).
        srv.stop()
        jobs = Path(srv.store) / "jobs"
        _newer(jobs / "newref" / "refs" / "latest")
        _newer(jobs / "newcommit" / "steps" / "2" / "commit.json")
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(newer: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=newer.url, timeout=30.0) as c:
        yield c


def test_job_list_keeps_every_job(api: httpx.Client) -> None:
    r = api.get("/v1/jobs")
    assert r.status_code == 200, r.text
    jobs = {j["job"]: j for j in r.json()["jobs"]}
    assert jobs["good"]["latest"] == 1 and "damaged" not in jobs["good"]
    assert jobs["newref"]["latest"] is None and "damaged" not in jobs["newref"]
    assert "jobs/newref/refs/latest" in jobs["newref"]["unsupported"]
    assert "upgrade ckptd" in jobs["newref"]["unsupported"]


def test_steps_show_the_newer_step(api: httpx.Client) -> None:
    r = api.get("/v1/jobs/newcommit/steps")
    assert r.status_code == 200, r.text
    steps = {s["step"]: s for s in r.json()["steps"]}
    assert steps[1]["committed"] and "damaged" not in steps[1]
    assert "jobs/newcommit/steps/2/commit.json" in steps[2]["unsupported"]
    r = api.get("/v1/jobs/newref/steps")  # its ref is newer; its steps still list
    assert r.status_code == 200 and [s["step"] for s in r.json()["steps"]] == [1]


def test_overview_keeps_every_job(api: httpx.Client) -> None:
    r = api.get("/v1/overview")
    assert r.status_code == 200, r.text
    views = {j["job"]: j for j in r.json()["jobs"]}
    assert set(views) == {"good", "newref", "newcommit"}
    assert views["good"]["latest"] == 1 and "damaged" not in views["good"]
    assert "jobs/newref/refs/latest" in views["newref"]["unsupported"]
    steps = {s["step"]: s for s in views["newcommit"]["steps"]}
    assert "upgrade ckptd" in steps[2]["unsupported"] and steps[1]["committed"]


def test_space_counts_around_the_newer_record(api: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while True:  # the census's first pass over the store
        r = api.get("/v1/space")
        assert r.status_code == 200, r.text
        if r.json()["complete"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {j["job"] for j in r.json()["jobs"]} >= {"good", "newcommit"}
    assert any("jobs/newcommit/steps/2/commit.json" in d for d in r.json()["damaged"])


@pytest.mark.parametrize("where", ["server", "store"])
def test_ckptd_ls_keeps_every_job(newer: ServerProcess, where: str) -> None:
    url = newer.url if where == "server" else f"file://{newer.store}"
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("CKPTD_TOKEN", None)
    done = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--url", url],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr  # listed, but ckptd must be upgraded
    rows = {line.split()[1]: line for line in done.stdout.splitlines()
            if len(line.split()) > 2 and line.split()[1] in ("good", "newref", "newcommit")}
    assert set(rows) == {"good", "newref", "newcommit"}, done.stdout
    assert " 1 " in rows["good"] and "unsupported" in rows["newref"]
    assert "[unsupported_format] newref: jobs/newref/refs/latest" in done.stderr
    assert "upgrade ckptd" in done.stderr and "Traceback" not in done.stderr
    one = subprocess.run([sys.executable, "-m", "ckptd", "ls", "newcommit", "--url", url],
                         capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 1, one.stderr
    assert "[unsupported_format] step 2: jobs/newcommit/steps/2/commit.json" in " ".join(
        one.stderr.split())
    assert "unsupported" in one.stdout and "committed" in one.stdout
    # A job whose steps read but whose latest ref is newer: said, and exit 1 (it
    # listed step 1 as committed, none as latest, and exited 0).
    ref = subprocess.run([sys.executable, "-m", "ckptd", "ls", "newref", "--url", url],
                         capture_output=True, text=True, timeout=120, env=env)
    assert ref.returncode == 1, ref.stdout + ref.stderr
    assert "[unsupported_format] newref latest: jobs/newref/refs/latest" in " ".join(
        ref.stderr.split())


# -- direct reads: the store's document named, the caller not blamed --------------------


@pytest.mark.parametrize(("path", "key"), [
    ("/v1/jobs/newcommit/steps/2", "jobs/newcommit/steps/2/commit.json"),
    ("/v1/jobs/newref/latest", "jobs/newref/refs/latest"),
    ("/v1/jobs/newref/restore-plan?rank=0", "jobs/newref/refs/latest"),
    ("/v1/jobs/newcommit/restore-plan?rank=0&step=2", "jobs/newcommit/steps/2/commit.json"),
    ("/v1/jobs/newcommit/step-plan?rank=0&step=2", "jobs/newcommit/steps/2/commit.json"),
])
def test_direct_reads_name_the_newer_document_not_the_caller(
        api: httpx.Client, path: str, key: str) -> None:
    # A 400 told a restoring rank its request was wrong; the store is newer than the
    # server, and it needs the server upgraded.
    r = api.get(path)
    assert r.status_code == 500, r.text
    body = r.json()
    assert body["code"] == "unsupported_stored_format", body
    assert body["detail"]["key"] == key and body["detail"]["version"] == 99
    assert "upgrade ckptd" in body["message"]


def test_the_client_raises_unsupported_format_at_once(newer: ServerProcess) -> None:
    from ckptd.errors import UnsupportedFormat, UnsupportedStoredFormat

    asked = "GET /v1/jobs/newref/latest"
    with Checkpointer(newer.url, "newref", serve_peers=False, heartbeat_interval=0) as ckpt:
        before = newer.log().count(asked)
        with pytest.raises(UnsupportedFormat, match="upgrade ckptd") as err:
            ckpt.restore({"w": torch.zeros(32, 32)})
    assert isinstance(err.value, UnsupportedStoredFormat)
    assert err.value.detail["key"] == "jobs/newref/refs/latest"
    # Not retried as a 5xx: asking again gets the same document.
    assert newer.log().count(asked) == before + 1, newer.log()[-2000:]


def test_ckptd_status_says_the_newer_latest_is_unreadable(newer: ServerProcess) -> None:
    # It said "last committed none": a job with nothing to restore.
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("CKPTD_TOKEN", None)
    done = subprocess.run([sys.executable, "-m", "ckptd", "status", "--url", newer.url],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    title = next(line for line in done.stdout.splitlines() if line.startswith("newref "))
    assert "last committed none" not in title and "upgrade ckptd" in title, done.stdout
    assert "latest: jobs/newref/refs/latest" in " ".join(done.stdout.split())
    good = next(line for line in done.stdout.splitlines() if line.startswith("good "))
    assert "last committed 1" in good
