"""``ckptd verify`` end to end (item 7): refs, commit records, manifests and chunks,
each bad chunk named with the steps, ranks and tensors it breaks, progress in bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.hashing import chunk_id
from tests.cli_runs import ckptd as run_ckptd
from tests.conftest import ServerProcess

JOBS = {"clean": 0, "gone": 1, "rot": 2, "torn": 3, "tagged": 4, "retag": 5}


def _emb(job: str) -> torch.Tensor:
    """A tensor of each job's own (no chunk is shared across jobs)."""
    return torch.arange(4096, dtype=torch.float32) + 10_000 * JOBS[job]


def _save(url: str, job: str, steps: list[int]) -> None:
    with Checkpointer(url, job, chunk_size=4096, serve_peers=False, heartbeat_interval=0) as ckpt:
        for step in steps:
            # "emb" never changes (its chunks are shared by every step), "head" does.
            state = {"emb": _emb(job),
                     "head": torch.full((1024,), float(step))}
            assert ckpt.save(step, state).wait(timeout=60).state == "committed"


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(store=tmp_path_factory.mktemp("verify") / "store")
    srv.start()
    try:
        _save(srv.url, "clean", [1])
        _save(srv.url, "gone", [1, 2])
        _save(srv.url, "rot", [1, 2])
        _save(srv.url, "torn", [1, 2])
        _save(srv.url, "tagged", [1])
        _save(srv.url, "retag", [1])
        jobs = srv.store / "jobs"
        (jobs / "tagged" / "refs" / "tags").write_bytes(b"[1,2]")  # JSON, not the tags
        shutil.rmtree(jobs / "gone" / "steps" / "2")  # deleted by hand
        record = jobs / "torn" / "steps" / "1" / "commit.json"
        record.write_bytes(record.read_bytes()[:30])
        # One chunk of "emb", which both steps of "rot" share.
        emb = _emb("rot").numpy().tobytes()[:4096]
        cid = chunk_id(emb)
        path = srv.store / "chunks" / cid[:2] / cid
        data = path.read_bytes()
        path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
        yield srv
    finally:
        srv.stop()


def _cli(srv: ServerProcess, job: str) -> subprocess.CompletedProcess[str]:
    return run_ckptd("verify", job, "--url", srv.url, environ=dict(os.environ), timeout=120)


def test_clean_job_verifies(store_server: ServerProcess) -> None:
    out = _cli(store_server, "clean")
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_step_deleted_by_hand_is_caught_at_its_ref(store_server: ServerProcess) -> None:
    out = _cli(store_server, "gone")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "bad ref" in out.stdout and "latest" in out.stdout and "step 2" in out.stdout


def test_a_damaged_commit_record_is_named(store_server: ServerProcess) -> None:
    out = _cli(store_server, "torn")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "jobs/torn/steps/1/commit.json" in out.stdout.replace("\n", "")
    assert "Traceback" not in out.stderr


def test_a_damaged_tags_ref_is_named(store_server: ServerProcess) -> None:
    out = _cli(store_server, "tagged")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "bad ref" in out.stdout
    assert "jobs/tagged/refs/tags" in out.stdout.replace("\n", "")


def test_a_damaged_tags_ref_says_how_to_replace_it(store_server: ServerProcess) -> None:
    tags = store_server.store / "jobs" / "retag" / "refs" / "tags"
    tags.write_bytes(b"[1,2]")
    with httpx.Client(base_url=store_server.url, timeout=60) as c:
        r = c.get("/v1/jobs/retag/tags")
        assert r.status_code == 500 and r.json()["code"] == "store_corrupt", r.text
        assert str(tags) in r.json()["message"], r.text
        assert "ckptd tag retag STEP NAME" in r.json()["message"], r.text
        tags.unlink()  # as it says (a tag set over it is refused: test_damaged_tags.py)
        done = subprocess.run([sys.executable, "-m", "ckptd", "tag", "retag", "1", "best",
                               "--url", store_server.url],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        r = c.get("/v1/jobs/retag/tags")
        assert r.status_code == 200 and "best" in r.text, r.text


def test_a_bad_chunk_names_the_steps_ranks_and_tensors_it_breaks(
    store_server: ServerProcess,
) -> None:
    out = _cli(store_server, "rot")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout.replace("\n", " ")
    assert "corrupt" in text and "step 1 rank 0 emb" in text and "step 2 rank 0 emb" in text


def test_streamed_verify_reports_progress_in_bytes(store_server: ServerProcess) -> None:
    with httpx.Client(base_url=store_server.url, timeout=60) as c:
        r = c.post("/v1/jobs/rot/verify", headers={"Accept": "application/x-ndjson"})
    lines = [json.loads(x) for x in r.text.splitlines() if x.strip()]
    assert any("bytes_checked" in x for x in lines[:-1])
    report = lines[-1]["report"]
    assert report["ok"] is False and report["bytes_total"] > 0
    # A corrupt chunk was read whole too (a probe: "checked 5 chunks (4.5 MiB)" of 8.5).
    assert report["bytes_checked"] == report["bytes_total"], report
    (damage,) = report["damage"]
    assert {(u["step"], u["tensor"]) for u in damage["breaks"]} == {(1, "emb"), (2, "emb")}
