"""Issue 20, item 4: /metrics keeps tenants apart.

Job ``beta`` uploads bytes only ``alpha`` had stored. Without a token /metrics
shows process and request health only: no store total whose change would tell
beta the chunk was there, no job's name. Beta's own token adds beta's series;
a token that reads every job (and the server's) sees it all."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.hashing import chunk_id
from ckptd.tokens import create_token
from tests.conftest import ServerProcess

ADMIN = "metrics-admin-token"
# Series that tell whether a chunk was new to the store, or about other jobs.
STORE_WIDE = ("ckptd_chunks_stored", "ckptd_stored_bytes", "ckptd_chunks_offered",
              "ckptd_chunks_missing", "ckptd_dedup_ratio", "ckptd_commits",
              "ckptd_heartbeats", "ckptd_manifests_stored", "ckptd_store_chunk_bytes",
              "ckptd_step_unique_bytes")


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    path = tmp_path / "tokens.json"
    tokens = {job: create_token(path, job, "write")[0] for job in ("alpha", "beta")}
    tokens["ops"] = create_token(path, "*", "read")[0]
    srv = ServerProcess(store=tmp_path / "store", token=ADMIN,
                        extra_args=["--tokens-file", str(path)])
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([a-z_]+?)(?:_total|_count|_sum|_bucket|_created)?"
                                            r"[{ ]", text, re.M)}


def jobs(text: str) -> set[str]:
    return set(re.findall(r'job="([^"]+)"', text))


def scrape(srv: ServerProcess, token: str | None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{srv.url}/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.text


def test_open_metrics_reveal_nothing_about_jobs_or_dedup(
    tenants: tuple[ServerProcess, dict[str, str]],
) -> None:
    srv, tokens = tenants
    data = b"only alpha had these bytes" * 100
    cid = chunk_id(data)
    for job in ("alpha", "beta"):
        auth = {"Authorization": f"Bearer {tokens[job]}"}
        r = httpx.put(f"{srv.url}/v1/chunks/{cid}", content=data, headers=auth, timeout=10)
        assert r.status_code in (200, 201), r.text
        r = httpx.post(f"{srv.url}/v1/jobs/{job}/ranks/0/heartbeat", json={"world_size": 1},
                       headers=auth, timeout=10)
        assert r.status_code == 200, r.text

    anonymous = scrape(srv, None)
    assert not jobs(anonymous), anonymous
    assert not names(anonymous) & set(STORE_WIDE), names(anonymous)
    # What stays open: the process's health and the requests' (summed over jobs).
    assert {"process_resident_memory_bytes", "process_open_fds",
            "ckptd_chunk_upload_seconds"} <= names(anonymous)

    beta = scrape(srv, tokens["beta"])
    assert jobs(beta) == {"beta"}, beta
    assert not names(beta) & set(STORE_WIDE)
    assert 'ckptd_ranks{job="beta",state="alive"} 1.0' in beta

    for everything in (tokens["ops"], ADMIN):
        text = scrape(srv, everything)
        assert jobs(text) == {"alpha", "beta"}
        assert "ckptd_chunks_stored_total 1.0" in text  # stored once: alpha's upload

    r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
