"""``GET /metrics`` (Prometheus), ``GET /v1/overview`` and the dashboard page, against
a real ``ckptd serve`` process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.hashing import chunk_id
from tests.conftest import ServerProcess
from tests.integration.test_api import assert_error, commit, manifest, put_manifest, tensor
from tests.integration.test_liveness import beat


@pytest.fixture(scope="module")
def srv(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=30.0) as c:
        yield c


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_counters_move_after_uploads(client: httpx.Client) -> None:
    before = scrape(client)
    for name in ("ckptd_chunks_stored_total", "ckptd_stored_bytes_total",
                 "ckptd_chunk_upload_seconds_count", "ckptd_heartbeats_total"):
        assert (name, ()) in before, name

    new = [os.urandom(4096) for _ in range(3)]
    ids = [chunk_id(d) for d in new]
    r = client.post("/v1/chunks/missing", json={"ids": ids, "claimer": "r0"})
    assert r.json()["missing"] == ids
    for cid, data in zip(ids, new, strict=True):
        assert client.put(f"/v1/chunks/{cid}", content=data).status_code == 201
    # The same ids again: a replica offering what is stored; nothing new to store.
    assert client.post("/v1/chunks/missing", json={"ids": ids}).json()["missing"] == []
    assert client.put(f"/v1/chunks/{ids[0]}", content=new[0]).status_code == 200
    # A refused upload.
    r = client.put(f"/v1/chunks/{chunk_id(b'other')}", content=b"not other")
    assert_error(r, 422, "chunk_hash_mismatch")
    # A restore read.
    assert client.get(f"/v1/chunks/{ids[1]}").content == new[1]

    after = scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("ckptd_chunks_stored_total") == 3
    assert moved("ckptd_stored_bytes_total") == 3 * 4096
    assert moved("ckptd_chunks_offered_total") == 6
    assert moved("ckptd_chunks_missing_total") == 3
    assert value(after, "ckptd_dedup_ratio") == pytest.approx(
        value(after, "ckptd_chunks_offered_total") / value(after, "ckptd_chunks_missing_total")
    )
    assert moved("ckptd_chunk_upload_seconds_count") == 4  # 3 new + 1 already stored
    assert moved("ckptd_chunk_upload_bytes_sum") == 4 * 4096
    assert moved("ckptd_chunk_upload_bytes_bucket", le="65536.0") == 4
    assert moved("ckptd_uploads_rejected_total", code="chunk_hash_mismatch") == 1
    assert moved("ckptd_chunk_read_seconds_count") == 1
    assert moved("ckptd_chunk_read_bytes_sum") == 4096


def test_commits_by_reason_manifests_and_rank_gauges(client: httpx.Client) -> None:
    before = scrape(client)
    job = "metrics-job"
    for step, reason in ((1, None), (2, "health"), (3, "weird-reason")):
        for rank in range(2):
            e = tensor(client, "w", rows=(rank, rank + 1), global_rows=2)
            assert put_manifest(client, manifest(job, step, rank, 2, [e])).status_code == 201
        for _ in range(2):  # every rank calls commit: counted once
            meta = {"reason": reason} if reason else {}
            assert commit(client, job, step, meta=meta).status_code == 200
    beat(client, job, 0, 3)
    beat(client, job, 1, 3, health={"state": "degraded", "reasons": ["gpu hot"]})
    after = scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("ckptd_commits_total", reason="periodic") == 1
    assert moved("ckptd_commits_total", reason="health") == 1
    assert moved("ckptd_commits_total", reason="other") == 1
    assert moved("ckptd_manifests_stored_total") == 6
    assert value(after, "ckptd_ranks", job=job, state="alive") == 1
    assert value(after, "ckptd_ranks", job=job, state="degraded") == 1
    assert value(after, "ckptd_ranks", job=job, state="dead") == 0
    assert moved("ckptd_heartbeats_total") == 2

    # The dashboard's JSON shows the same commits and why each was taken.
    r = client.get("/v1/overview", params={"job": job})
    assert r.status_code == 200, r.text
    (view,) = r.json()["jobs"]
    assert view["latest"] == 3 and view["world_size"] == 3
    assert [(s["step"], s["committed"], s["reason"]) for s in view["steps"]] == [
        (1, True, "periodic"), (2, True, "health"), (3, True, "weird-reason"),
    ]
    assert [r["state"] for r in view["ranks"]] == ["alive", "degraded"]
    storage = r.json()["storage"]
    assert storage["commits"] >= 3 and storage["chunks_stored"] >= 6


def test_overview_lists_every_job(client: httpx.Client) -> None:
    beat(client, "metrics-heartbeat-only", 0, 1)
    e = tensor(client, "w", rows=(0, 1), global_rows=2)
    assert put_manifest(client, manifest("metrics-pending", 5, 0, 2, [e])).status_code == 201
    body = client.get("/v1/overview").json()
    jobs = {j["job"]: j for j in body["jobs"]}
    assert {"metrics-heartbeat-only", "metrics-pending"} <= set(jobs)
    assert jobs["metrics-heartbeat-only"]["steps"] == []
    (pending,) = jobs["metrics-pending"]["steps"]
    assert (pending["committed"], pending["ranks_present"], pending["reason"]) == (False, 1, None)
    assert_error(client.get("/v1/overview", params={"job": "../x"}), 400, "invalid_name")
    # One job: a job only a rank spoke of is there, a name nothing knows is not (an
    # invented empty job answered 200).
    only = client.get("/v1/overview", params={"job": "metrics-heartbeat-only", "steps": 0})
    assert only.status_code == 200 and only.json()["jobs"][0]["ranks"], only.text
    assert_error(client.get("/v1/overview", params={"job": "metrics-nosuch"}), 404,
                 "job_not_found")


def test_dashboard_page_and_static_files(client: httpx.Client) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert 'src="static/dashboard.js' in r.text and "$" not in r.text
    js = client.get("/static/dashboard.js")
    assert js.status_code == 200 and "v1/overview" in js.text
    assert "innerHTML" not in js.text  # client strings are drawn as text only
    assert client.get("/static/dashboard.css").status_code == 200
    assert client.get("/static/../app.py").status_code == 404


def test_metrics_open_by_default_and_behind_the_token_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_srv = ServerProcess(store=tmp_path / "a", token="t0k")
    open_srv.start()
    try:
        assert httpx.get(f"{open_srv.url}/metrics").status_code == 200
        assert httpx.get(f"{open_srv.url}/").status_code == 200  # the page holds no data
        assert_error(httpx.get(f"{open_srv.url}/v1/overview"), 401, "unauthorized")
        ok = httpx.get(f"{open_srv.url}/v1/overview", headers=open_srv.headers())
        assert ok.status_code == 200
    finally:
        open_srv.stop()
    monkeypatch.setenv("CKPTD_METRICS_TOKEN_REQUIRED", "true")
    closed = ServerProcess(store=tmp_path / "b", token="t0k")
    closed.start()
    try:
        assert_error(httpx.get(f"{closed.url}/metrics"), 401, "unauthorized")
        r = httpx.get(f"{closed.url}/metrics", headers=closed.headers())
        assert r.status_code == 200 and "ckptd_chunks_stored_total" in r.text
    finally:
        closed.stop()
