"""A damaged store degrades one step, not the service (item 6): damage is a 5xx
``store_corrupt`` naming the document, listings show it per job and step, and a
restore of "latest" falls back to the newest step that reads cleanly."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Jobs ``good`` (step 1), ``badref`` (step 1, garbage latest), ``badcommit``
    (steps 1 and 2, step 2's commit record half-written) and ``badmanifest`` (steps
    1 and 2, step 2's rank manifest half-written)."""
    srv = ServerProcess(store=tmp_path_factory.mktemp("damaged") / "store")
    srv.start()
    try:
        for job, steps in (("good", [1]), ("badref", [1]), ("badcommit", [1, 2]),
                           ("badmanifest", [1, 2])):
            with Checkpointer(srv.url, job, chunk_size=4096, serve_peers=False,
                              heartbeat_interval=0) as ckpt:
                for step in steps:
                    state = {"w": torch.full((64, 64), float(step)), "step": step}
                    assert ckpt.save(step, state).wait(timeout=60).state == "committed"
        jobs = srv.store / "jobs"
        (jobs / "badref" / "refs" / "latest").write_bytes(b"\x00garbage{")
        record = jobs / "badcommit" / "steps" / "2" / "commit.json"
        record.write_bytes(record.read_bytes()[:40])
        manifest = jobs / "badmanifest" / "steps" / "2" / "ranks" / "0.json"
        manifest.write_bytes(manifest.read_bytes()[:40])
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(damaged: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=damaged.url, timeout=30.0) as c:
        yield c


def test_listing_every_job_survives_one_damaged_ref(api: httpx.Client) -> None:
    r = api.get("/v1/jobs")
    assert r.status_code == 200, r.text
    jobs = {j["job"]: j for j in r.json()["jobs"]}
    assert jobs["good"]["latest"] == 1
    assert jobs["badcommit"]["latest"] == 2
    assert jobs["badref"]["latest"] is None
    assert "jobs/badref/refs/latest" in jobs["badref"]["damaged"]


def test_steps_show_the_damaged_step(api: httpx.Client) -> None:
    r = api.get("/v1/jobs/badcommit/steps")
    assert r.status_code == 200, r.text
    steps = {s["step"]: s for s in r.json()["steps"]}
    assert steps[1]["committed"] and "damaged" not in steps[1]
    assert "jobs/badcommit/steps/2/commit.json" in steps[2]["damaged"]


def test_damage_is_a_coded_5xx_naming_the_document(api: httpx.Client) -> None:
    r = api.get("/v1/jobs/badcommit/steps/2")
    assert r.status_code >= 500, r.text
    body = r.json()
    assert body["code"] == "store_corrupt"
    assert body["detail"]["key"] == "jobs/badcommit/steps/2/commit.json"


def test_overview_keeps_every_job(api: httpx.Client) -> None:
    r = api.get("/v1/overview")
    assert r.status_code == 200, r.text
    views = {j["job"]: j for j in r.json()["jobs"]}
    assert set(views) >= {"good", "badref", "badcommit"}
    assert views["badref"]["latest"] is None and views["good"]["latest"] == 1
    assert any(s.get("damaged") for s in views["badcommit"]["steps"])


def _ls(damaged: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return run_ckptd("ls", *args, "--url", damaged.url, environ={**os.environ, "COLUMNS": "200"})


def test_cli_ls_lists_every_job_and_exits_1_on_damage(damaged: ServerProcess) -> None:
    for args in ([], ["badcommit"], ["badref"], ["badmanifest"]):
        out = _ls(damaged, *args)
        assert out.returncode == 1, out.stdout + out.stderr  # damage listed: not clean
        assert "Traceback" not in out.stderr
        if not args:
            assert "good" in out.stdout and "badref" in out.stdout
        if args == ["badcommit"]:
            assert "damaged" in out.stdout
    good = _ls(damaged, "good")
    assert good.returncode == 0, good.stdout + good.stderr


def _rows(out: str) -> dict[str, str]:
    """A table's rows by their first cell."""
    cells = [line.replace("\u2502", " ").split() for line in out.splitlines()]
    return {c[0]: " ".join(c) for c in cells if c}


def test_cli_ls_shows_the_step_a_restore_of_latest_uses(damaged: ServerProcess) -> None:
    rows = _rows(_ls(damaged, "badmanifest").stdout)
    assert "damaged" in rows["2"] and "latest" not in rows["2"], rows
    assert "latest" in rows["1"], rows
    jobs = {k: v for k, v in _rows(_ls(damaged).stdout).items() if k.startswith("bad")}
    # The step /latest and restores use, and the damaged one the ref names; a
    # garbage commit record is "damaged", not "unreadable" (a newer ckptd's).
    assert "1 (2 damaged)" in jobs["badmanifest"], jobs
    assert "1 (2 damaged)" in jobs["badcommit"], jobs
    assert "unreadable" not in "".join(jobs.values()), jobs


def test_restore_of_latest_falls_back_and_says_so(damaged: ServerProcess, api: httpx.Client
                                                  ) -> None:
    state = {"w": torch.zeros((64, 64)), "step": 0}
    with Checkpointer(damaged.url, "badcommit", chunk_size=4096, serve_peers=False,
                      heartbeat_interval=0) as ckpt:
        result = ckpt.restore(state)
    assert result.step == 1
    assert torch.equal(state["w"], torch.full((64, 64), 1.0)) and state["step"] == 1
    damaged_docs = [p for p in result.problems if p.kind == "damaged"]
    assert damaged_docs and "steps/2/commit.json" in damaged_docs[0].message
    events = api.get("/v1/jobs/badcommit/events").json()["events"]
    assert any(e["kind"] == "restore_fallback" and e["step"] == 1 for e in events)


def test_a_good_job_restores_without_problems(damaged: ServerProcess) -> None:
    state = {"w": torch.zeros((64, 64)), "step": 0}
    with Checkpointer(damaged.url, "good", chunk_size=4096, serve_peers=False,
                      heartbeat_interval=0) as ckpt:
        result = ckpt.restore(state)
    assert result.step == 1 and not [p for p in result.problems if p.kind == "damaged"]


def test_damage_after_a_server_read_shows_in_its_overview(tmp_path: Path) -> None:
    """(Found by a probe.) Damaged after this server had read them, the ``latest`` ref
    and a commit record showed as they were before on the dashboard and in ``ckptd
    status``, while ``ckptd ls`` said damaged, until the server restarted: the ref's
    last value was kept when it stopped reading, the record forever."""
    srv = ServerProcess(store=tmp_path / "store", extra_args=["--heartbeat-interval", "0.2"])
    srv.start()
    try:
        with Checkpointer(srv.url, "later", chunk_size=4096, serve_peers=False,
                          heartbeat_interval=0) as ckpt:
            for step in (1, 2):
                assert ckpt.save(step, {"w": torch.full((64,), float(step))}).wait(
                    timeout=60).state == "committed"
        view = httpx.get(f"{srv.url}/v1/overview", params={"job": "later"}, timeout=30).json()
        assert view["jobs"][0]["latest"] == 2
        jobs = srv.store / "jobs" / "later"
        (jobs / "refs" / "latest").write_bytes(b"garbage")
        record = jobs / "steps" / "1" / "commit.json"
        record.write_bytes(record.read_bytes()[:10])
        deadline = time.monotonic() + 20  # (a record is read again after 30 intervals: 6 s)
        while True:
            job = httpx.get(f"{srv.url}/v1/overview", params={"job": "later"},
                            timeout=30).json()["jobs"][0]
            steps = {s["step"]: s for s in job["steps"]}
            if (job["latest"] is None and job.get("damaged")
                    and steps[1].get("damaged")) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert job["latest"] is None and "jobs/later/refs/latest" in job["damaged"], job
        assert "jobs/later/steps/1/commit.json" in steps[1]["damaged"], steps[1]
        assert steps[2]["committed"] and not steps[2].get("damaged")
    finally:
        srv.stop()
