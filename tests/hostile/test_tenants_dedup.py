"""Issue 10, item 12: deduplication reveals nothing across tenants.

Chunks are stored once for the whole store, but whether a chunk is stored (a
missing-chunks answer, HEAD, GET, the 200/201 of a PUT, an in-flight lease) is
told to a scoped token only for chunks its own job knows of."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.chunk_reads import CHUNK_SIZES_HEADER
from ckptd.hashing import chunk_id
from ckptd.tokens import create_token
from tests.conftest import ServerProcess

ROOT = "root-admin-token"


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    path = tmp_path / "tokens.json"
    tokens = {
        "a": create_token(path, "alpha", "write")[0],
        "a-read": create_token(path, "alpha", "read")[0],
        "b": create_token(path, "beta", "write")[0],
    }
    srv = ServerProcess(store=tmp_path / "store", token=ROOT,
                        extra_args=["--tokens-file", str(path)])
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def client(srv: ServerProcess, token: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {token}"},
                        timeout=30.0)


def test_a_chunk_of_another_tenant_looks_absent(
    tenants: tuple[ServerProcess, dict[str, str]],
) -> None:
    srv, tokens = tenants
    secret = b"beta's private weights" * 100
    cid = chunk_id(secret)
    with client(srv, tokens["b"]) as b, client(srv, tokens["a"]) as a, \
            client(srv, tokens["a-read"]) as a_read, client(srv, ROOT) as root:
        assert b.put(f"/v1/chunks/{cid}", content=secret).status_code == 201
        # The operator sees the store as it is.
        assert root.post("/v1/chunks/missing", json={"ids": [cid]}).json()["missing"] == []
        assert root.head(f"/v1/chunks/{cid}").status_code == 200
        # Tenant alpha may not learn that beta holds these bytes, by any route.
        assert a.post("/v1/chunks/missing", json={"ids": [cid]}).json() == {
            "missing": [cid], "in_flight": []}
        assert a.head(f"/v1/chunks/{cid}").status_code == 404
        assert a.get(f"/v1/chunks/{cid}").status_code == 404
        assert a_read.get(f"/v1/chunks/{cid}").status_code == 404
        r = a_read.post("/v1/chunks/read", json={"ids": [cid]})
        assert (r.status_code, r.headers[CHUNK_SIZES_HEADER], r.content) == (200, "-", b"")
        # Sending the bytes proves alpha holds them: stored once, answered as new.
        r = a.put(f"/v1/chunks/{cid}", content=secret)
        assert (r.status_code, r.json()["created"]) == (201, True)
        assert a.post("/v1/chunks/missing", json={"ids": [cid]}).json()["missing"] == []
        assert a.get(f"/v1/chunks/{cid}").content == secret
        r = a_read.post("/v1/chunks/read", json={"ids": [cid, cid]})
        assert r.headers[CHUNK_SIZES_HEADER] == f"{len(secret)},{len(secret)}"
        assert r.content == secret + secret
        r = a.put(f"/v1/chunks/{cid}", content=secret)
        assert (r.status_code, r.json()["created"]) == (200, False)
    files = [p for p in (srv.store / "chunks").rglob("*") if p.is_file()]
    assert len(files) == 1  # deduplicated in the store all the same


def test_another_tenants_lease_is_not_shown_in_flight(
    tenants: tuple[ServerProcess, dict[str, str]],
) -> None:
    srv, tokens = tenants
    cid = chunk_id(b"being uploaded by beta")
    with client(srv, tokens["b"]) as b, client(srv, tokens["a"]) as a:
        r = b.post("/v1/chunks/missing", json={"ids": [cid], "claimer": "beta/0"})
        assert r.json() == {"missing": [cid], "in_flight": []}
        # Within beta, the lease dedups replicas: beta/1 waits for beta/0.
        r = b.post("/v1/chunks/missing", json={"ids": [cid], "claimer": "beta/1"})
        assert r.json() == {"missing": [], "in_flight": [cid]}
        # Alpha is told to send it itself, not that someone is sending it.
        r = a.post("/v1/chunks/missing", json={"ids": [cid], "claimer": "alpha/0"})
        assert r.json() == {"missing": [cid], "in_flight": []}


def test_committed_chunks_of_the_job_dedup_without_being_resent(
    tenants: tuple[ServerProcess, dict[str, str]], tmp_path: Path,
) -> None:
    """After a restart (no soft state), the job's committed manifests still tell
    which chunks it knows: an incremental save sends only what changed."""
    import torch

    from ckptd.client import Checkpointer

    srv, tokens = tenants
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with Checkpointer(srv.url, "alpha", token=tokens["a"], serve_peers=False,
                      shm_dir=tmp_path / "shm", chunk_size=4096) as ckpt:
        ckpt.save(1, state).wait(60)
    srv.restart()
    with client(srv, tokens["a"]) as a, client(srv, tokens["b"]) as b:
        plan = a.get("/v1/jobs/alpha/restore-plan", params={"rank": 0}).json()
        ids = [c for e in plan["manifest"]["entries"] for c in e["chunks"]]
        assert ids
        assert a.post("/v1/chunks/missing", json={"ids": ids}).json()["missing"] == []
        assert b.post("/v1/chunks/missing", json={"ids": ids}).json()["missing"] == ids
        assert b.get("/v1/jobs/alpha/restore-plan", params={"rank": 0}).status_code == 403


def test_a_manifest_may_name_only_chunks_its_job_knows(
    tenants: tuple[ServerProcess, dict[str, str]],
) -> None:
    """Naming another tenant's chunk id in a manifest neither tells whether it is
    stored nor, once the step commits, lets the job read it (found by review)."""
    from ckptd.format import TensorEntry
    from ckptd.testing.manifests import rank_manifest

    srv, tokens = tenants
    secret = b"beta's private weights" * 100
    cid = chunk_id(secret)
    mine = b"alpha's own weights" * 100
    nobody = "ab" * 32

    def manifest(step: int, ids: list[str], size: int) -> bytes:
        entry = TensorEntry(name="w", dtype="uint8", placement="replicated",
                            global_shape=[size], offsets=[0], shape=[size], nbytes=size,
                            chunks=ids)
        return rank_manifest("alpha", step, 0, 1, [entry], chunk_size=1 << 20).canonical()

    with client(srv, tokens["b"]) as b, client(srv, tokens["a"]) as a:
        assert b.put(f"/v1/chunks/{cid}", content=secret).status_code == 201
        answers = []
        for step, named in ((1, cid), (2, nobody)):
            r = a.put(f"/v1/jobs/alpha/steps/{step}/ranks/0", content=manifest(
                step, [named], len(secret)), headers={"Content-Type": "application/json"})
            answers.append((r.status_code, r.json()["code"], r.json()["detail"]["count"]))
        # Stored by beta or by nobody: the same answer.
        assert answers[0] == answers[1] == (409, "missing_chunks", 1)
        assert a.post("/v1/jobs/alpha/steps/1/commit", json={}).status_code != 200
        assert a.get(f"/v1/chunks/{cid}").status_code == 404
        # Its own chunk, once sent, it may name; and beta's, once it sent the bytes.
        assert a.put(f"/v1/chunks/{chunk_id(mine)}", content=mine).status_code == 201
        r = a.put("/v1/jobs/alpha/steps/3/ranks/0", content=manifest(
            3, [chunk_id(mine)], len(mine)), headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text
        assert a.put(f"/v1/chunks/{cid}", content=secret).status_code in (200, 201)
        r = a.put("/v1/jobs/alpha/steps/1/ranks/0", content=manifest(1, [cid], len(secret)),
                  headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text
