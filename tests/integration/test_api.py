"""The HTTP API (docs/API.md) against a real ``ckptd serve`` process."""

from __future__ import annotations

import http.client
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from ckptd import knobs
from ckptd.format import MIN_CHUNK_SIZE, RankManifest, TensorEntry
from ckptd.hashing import chunk_id, chunk_spans

if TYPE_CHECKING:
    from tests.conftest import ServerProcess

CHUNK = MIN_CHUNK_SIZE  # small chunks keep every test fast
COLS = 256  # float32 columns: one row is 1 KiB
JSON = {"content-type": "application/json"}


# -- helpers ------------------------------------------------------------------------


# Most tests here share one server (``shared_server``, tests/integration/conftest.py)
# and so its store: each names its own jobs (``job``). A test that restarts its
# server or looks at the whole store (the job list, every chunk file) has one of its
# own (``server``, with ``fresh_client``).


@pytest.fixture
def client(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the module's shared server."""
    with httpx.Client(base_url=shared_server.url, headers=shared_server.headers(),
                      timeout=30.0) as c:
        yield c


@pytest.fixture
def fresh_client(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the test's own server, on an empty store."""
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=30.0) as c:
        yield c


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job name of this test's own (from its name): the shared store's other tests
    name theirs from their own."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name.removeprefix("test_"))[:128]


def put_chunk(client: httpx.Client, data: bytes) -> str:
    cid = chunk_id(data)
    r = client.put(f"/v1/chunks/{cid}", content=data)
    assert r.status_code in (200, 201), r.text
    return cid


def tensor(
    client: httpx.Client | None,
    name: str,
    *,
    rows: tuple[int, int],
    global_rows: int,
    placement: str = "sharded",
    dtype: str = "float32",
    data: bytes | None = None,
) -> TensorEntry:
    """A [global_rows, COLS] tensor's shard of rows [start, end), its chunks uploaded
    (when ``client`` is given)."""
    start, end = rows
    nbytes = (end - start) * COLS * 4
    data = os.urandom(nbytes) if data is None else data
    assert len(data) == nbytes
    chunks = []
    for a, b in chunk_spans(nbytes, CHUNK):
        piece = data[a:b]
        chunks.append(put_chunk(client, piece) if client is not None else chunk_id(piece))
    return TensorEntry(
        name=name,
        dtype=dtype,
        placement=placement,  # type: ignore[arg-type]
        global_shape=[global_rows, COLS],
        offsets=[start, 0],
        shape=[end - start, COLS],
        nbytes=nbytes,
        chunks=chunks,
    )


def manifest(
    job: str, step: int, rank: int, world: int, entries: list[TensorEntry], **extra: Any
) -> RankManifest:
    tree = {"dict": [[e.name, {"tensor": e.name}] for e in entries] + [["step", {"value": step}]]}
    return RankManifest(
        job=job,
        step=step,
        rank=rank,
        world_size=world,
        chunk_size=CHUNK,
        entries=entries,
        tree=tree,
        **extra,
    )


def manifest_path(job: str, step: int, rank: int) -> str:
    return f"/v1/jobs/{job}/steps/{step}/ranks/{rank}"


def put_manifest(client: httpx.Client, m: RankManifest) -> httpx.Response:
    return client.put(manifest_path(m.job, m.step, m.rank), content=m.canonical(), headers=JSON)


def commit(client: httpx.Client, job: str, step: int, **body: Any) -> httpx.Response:
    if body:
        return client.post(f"/v1/jobs/{job}/steps/{step}/commit", json=body)
    return client.post(f"/v1/jobs/{job}/steps/{step}/commit")


def sharded_step(client: httpx.Client, job: str, step: int, world: int) -> list[RankManifest]:
    """Puts a step whose one tensor is split by rows over ``world`` ranks."""
    manifests = []
    for rank in range(world):
        e = tensor(client, "w", rows=(rank, rank + 1), global_rows=world)
        m = manifest(job, step, rank, world, [e])
        r = put_manifest(client, m)
        assert r.status_code == 201, r.text
        manifests.append(m)
    return manifests


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and isinstance(body["detail"], dict)
    return body


def raw(
    server: ServerProcess,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, bytes]:
    """One request with the path sent exactly as given (httpx would normalize '..')."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        length = {"Content-Length": str(len(body))} if body is not None else {}
        for k, v in {**server.headers(), **length, **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def chunk_file(server: ServerProcess, cid: str) -> Path:
    return server.store / "chunks" / cid[:2] / cid


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


# -- the service ----------------------------------------------------------------------


def test_healthz(client: httpx.Client, shared_server: ServerProcess) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["version"]
    assert str(shared_server.store.name) in body["store"]


def test_openapi_document_is_complete(client: httpx.Client) -> None:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    paths = doc["paths"]
    expected = {
        ("/healthz", "get"),
        ("/livez", "get"),
        ("/v1/chunks/missing", "post"),
        ("/v1/chunks/{id}", "put"),
        ("/v1/chunks/{id}", "head"),
        ("/v1/chunks/{id}", "get"),
        ("/v1/chunks/read", "post"),
        ("/v1/jobs/{job}/steps/{step}/ranks/{rank}", "put"),
        ("/v1/jobs/{job}/steps/{step}/ranks/{rank}", "get"),
        ("/v1/jobs/{job}/steps/{step}/commit", "post"),
        ("/v1/jobs", "get"),
        ("/v1/jobs/{job}/steps", "get"),
        ("/v1/jobs/{job}/steps/{step}", "get"),
        ("/v1/jobs/{job}/latest", "get"),
        ("/v1/jobs/{job}/verify", "post"),
        ("/v1/jobs/{job}/ranks/{rank}/heartbeat", "post"),
        ("/v1/jobs/{job}/ranks/{rank}/heartbeat", "delete"),
        ("/v1/jobs/{job}/ranks", "get"),
        ("/v1/jobs/{job}/restore-plan", "get"),
        ("/v1/jobs/{job}/step-plan", "get"),
        ("/v1/jobs/{job}/snapshot-requests", "post"),
        ("/v1/jobs/{job}/rollback", "post"),
        ("/v1/jobs/{job}/rollback", "delete"),
        ("/v1/jobs/{job}/rollback", "get"),
        ("/v1/jobs/{job}/events", "get"),
        ("/v1/overview", "get"),
        ("/v1/cluster", "get"),
        ("/metrics", "get"),
        ("/", "get"),
        # the store lifecycle (server/routes/lifecycle.py)
        ("/v1/gc", "post"),
        ("/v1/gc", "get"),
        ("/v1/gc/runs", "post"),
        ("/v1/jobs/{job}/forget", "post"),
        ("/v1/scrub", "post"),
        ("/v1/scrub", "get"),
        ("/v1/scrub/runs", "post"),
        ("/v1/jobs/{job}/tags", "get"),
        ("/v1/jobs/{job}/tags/{name}", "put"),
        ("/v1/jobs/{job}/tags/{name}", "delete"),
        ("/v1/jobs/{job}/damage", "get"),
        ("/v1/space", "get"),
    }
    assert {(p, m) for p, ops in paths.items() for m in ops} == expected
    # Every reference resolves, and the manifest PUT documents its body.
    schemas = doc["components"]["schemas"]
    for ref in re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', r.text):
        assert ref in schemas, ref
    put = paths["/v1/jobs/{job}/steps/{step}/ranks/{rank}"]["put"]
    body_schema = put["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema == {"$ref": "#/components/schemas/RankManifest"}
    assert "octet-stream" in str(paths["/v1/chunks/{id}"]["put"]["requestBody"])
    assert "ErrorBody" in schemas


# -- chunks ---------------------------------------------------------------------------


def test_chunk_roundtrip_streams_identical_bytes(client: httpx.Client) -> None:
    data = os.urandom(3 * knobs.MiB + 12345)  # several 1 MiB pieces and a short one
    cid = chunk_id(data)
    r = client.put(f"/v1/chunks/{cid}", content=data)
    assert r.status_code == 201
    assert r.json() == {"id": cid, "size": len(data), "created": True}
    r = client.put(f"/v1/chunks/{cid}", content=data)
    assert r.status_code == 200
    assert r.json()["created"] is False

    r = client.get(f"/v1/chunks/{cid}")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert int(r.headers["content-length"]) == len(data)
    assert r.content == data
    assert client.head(f"/v1/chunks/{cid}").status_code == 200


def test_chunk_upload_streamed_without_length(client: httpx.Client) -> None:
    data = os.urandom(2 * knobs.MiB + 7)
    cid = chunk_id(data)

    def pieces() -> Iterator[bytes]:
        for a in range(0, len(data), 100_000):
            yield data[a : a + 100_000]

    r = client.put(f"/v1/chunks/{cid}", content=pieces())
    assert r.status_code == 201, r.text
    assert client.get(f"/v1/chunks/{cid}").content == data


def test_absent_chunk_is_404(client: httpx.Client) -> None:
    cid = chunk_id(b"never stored")
    assert client.head(f"/v1/chunks/{cid}").status_code == 404
    assert_error(client.get(f"/v1/chunks/{cid}"), 404, "chunk_not_found")


def test_a_chunk_is_served_as_stored_without_a_second_hash(
    client: httpx.Client, shared_server: ServerProcess
) -> None:
    # One hash per hop: the reader verifies on arrival, so the server streams the
    # stored bytes, even bytes damaged at rest (``ckptd verify`` finds those).
    data = os.urandom(64 * 1024)
    cid = put_chunk(client, data)
    damaged = bytearray(data)
    damaged[100] ^= 0xFF
    chunk_file(shared_server, cid).write_bytes(bytes(damaged))
    r = client.get(f"/v1/chunks/{cid}")
    assert r.status_code == 200
    assert r.content == bytes(damaged)


def test_chunk_whose_bytes_do_not_match_its_id_is_refused(
    fresh_client: httpx.Client, server: ServerProcess
) -> None:
    data = os.urandom(64 * 1024)
    claimed = chunk_id(os.urandom(64 * 1024))
    body = assert_error(
        fresh_client.put(f"/v1/chunks/{claimed}", content=data), 422, "chunk_hash_mismatch"
    )
    assert body["detail"]["actual"] == chunk_id(data)
    assert not chunk_file(server, claimed).exists()
    assert not chunk_file(server, chunk_id(data)).exists()
    # No temporary left either (every chunk file: its own server).
    assert files_under(server.store / "chunks") == set()
    assert fresh_client.head(f"/v1/chunks/{claimed}").status_code == 404


def test_chunk_declared_over_the_limit_is_refused_before_its_body(
    shared_server: ServerProcess,
) -> None:
    cid = chunk_id(os.urandom(16))  # (no other test's: the store is shared)
    status, body = raw(
        shared_server, "PUT", f"/v1/chunks/{cid}", {"Content-Length": str(knobs.MAX_CHUNK_SIZE + 1)}
    )
    assert status == 413
    assert b'"too_large"' in body
    assert not chunk_file(shared_server, cid).exists()


@pytest.mark.slow
def test_chunk_streamed_past_the_limit_is_refused(
    fresh_client: httpx.Client, server: ServerProcess
) -> None:
    piece = bytes(knobs.MiB)
    count = knobs.MAX_CHUNK_SIZE // len(piece)
    cid = chunk_id(b"whatever")

    def body() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for _ in range(count):
            yield piece
        yield b"!"

    try:
        r = fresh_client.put(f"/v1/chunks/{cid}", content=body())
    except httpx.TransportError:
        pytest.fail("the server cut the connection instead of answering 413")
    assert_error(r, 413, "too_large")
    assert files_under(server.store / "chunks") == set()  # (every chunk file: its own server)


# -- missing chunks -------------------------------------------------------------------


def test_missing_chunks_without_claimer(client: httpx.Client) -> None:
    present = put_chunk(client, os.urandom(1000))
    absent = [chunk_id(os.urandom(16)) for _ in range(3)]
    r = client.post("/v1/chunks/missing", json={"ids": [present, *absent, absent[0]]})
    assert r.status_code == 200
    assert r.json() == {"missing": absent, "in_flight": []}
    # Without a claimer nothing is leased: asking again gives the same answer.
    r = client.post("/v1/chunks/missing", json={"ids": absent})
    assert r.json() == {"missing": absent, "in_flight": []}


def test_missing_chunks_with_claimers(client: httpx.Client) -> None:
    data = os.urandom(100)  # (no other test's: the store and the claims are shared)
    a, b = chunk_id(data), chunk_id(os.urandom(100))
    r = client.post("/v1/chunks/missing", json={"ids": [a, b], "claimer": "rank-0"})
    assert r.json() == {"missing": [a, b], "in_flight": []}
    r = client.post("/v1/chunks/missing", json={"ids": [a, b], "claimer": "rank-1"})
    assert r.json() == {"missing": [], "in_flight": [a, b]}
    # The first claimer asking again still holds them.
    r = client.post("/v1/chunks/missing", json={"ids": [a, b], "claimer": "rank-0"})
    assert r.json() == {"missing": [a, b], "in_flight": []}
    # Once a is stored nobody is told to send it, and it is no longer in flight.
    put_chunk(client, data)
    r = client.post("/v1/chunks/missing", json={"ids": [a, b], "claimer": "rank-1"})
    assert r.json() == {"missing": [], "in_flight": [b]}


def test_missing_chunks_bad_input(client: httpx.Client) -> None:
    assert_error(client.post("/v1/chunks/missing", json={"ids": ["nothex"]}), 400, "invalid_name")
    assert_error(client.post("/v1/chunks/missing", json={"ids": "x"}), 400, "invalid_request")
    assert_error(client.post("/v1/chunks/missing", json={}), 400, "invalid_request")
    assert_error(
        client.post("/v1/chunks/missing", content=b"{not json", headers=JSON),
        400,
        "invalid_request",
    )
    too_many = ["0" * 64] * (knobs.missing_batch() + 1)
    assert_error(client.post("/v1/chunks/missing", json={"ids": too_many}), 413, "too_large")


# -- manifests and commits ------------------------------------------------------------


def test_manifest_naming_a_missing_chunk_is_refused(client: httpx.Client, job: str) -> None:
    e = tensor(None, "w", rows=(0, 2), global_rows=2)  # chunks never uploaded
    body = assert_error(put_manifest(client, manifest(job, 1, 0, 1, [e])), 409, "missing_chunks")
    assert set(body["detail"]["ids"]) == set(e.chunks)
    assert_error(commit(client, job, 1), 404, "manifest_not_found")


def test_commit_and_read_back(fresh_client: httpx.Client) -> None:
    job, step, world = "train.run-1", 10, 2
    shared = os.urandom(2 * COLS * 4)
    manifests = []
    for rank in range(world):
        entries = [
            tensor(fresh_client, "w", rows=(rank * 3, rank * 3 + 3), global_rows=3 * world),
            tensor(fresh_client, "bias", rows=(0, 2), global_rows=2, placement="replicated",
                   data=shared),
            tensor(fresh_client, "rng", rows=(0, 1), global_rows=1, placement="local"),
        ]
        m = manifest(job, step, rank, world, entries)
        r = put_manifest(fresh_client, m)
        assert r.status_code == 201, r.text
        assert r.json() == {"hash": m.digest()}
        assert put_manifest(fresh_client, m).status_code == 201  # a retry is a no-op
        manifests.append(m)

    r = commit(fresh_client, job, step, meta={"loss": 1.5})
    assert r.status_code == 200, r.text
    status = r.json()
    assert status["state"] == "committed"
    assert (status["job"], status["step"], status["world_size"]) == (job, step, world)
    assert status["missing_ranks"] == []
    record = status["record"]
    assert [m["hash"] for m in record["manifests"]] == [m.digest() for m in manifests]
    assert record["meta"] == {"loss": 1.5}
    assert commit(fresh_client, job, step).json()["record"] == record  # idempotent

    assert fresh_client.get(f"/v1/jobs/{job}/steps/{step}").json() == record
    for m in manifests:
        r = fresh_client.get(manifest_path(job, step, m.rank))
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert r.content == m.canonical()
        assert r.headers["x-ckptd-manifest-hash"] == m.digest()
    assert fresh_client.get(f"/v1/jobs/{job}/latest").json() == {"job": job, "step": step}
    # (the whole job list: its own server)
    assert fresh_client.get("/v1/jobs").json() == {"jobs": [{"job": job, "latest": step}]}
    steps = fresh_client.get(f"/v1/jobs/{job}/steps").json()
    assert steps["job"] == job and steps["latest"] == step
    (info,) = steps["steps"]
    assert info["step"] == step and info["committed"] and info["is_latest"]
    assert info["world_size"] == world and info["ranks_present"] == world
    assert info["logical_bytes"] == record["report"]["logical_bytes"]

    report = fresh_client.post(f"/v1/jobs/{job}/verify", params={"step": step}).json()
    assert report["ok"] is True and report["steps"] == [step]
    assert report["chunks_checked"] == len({c for m in manifests for c in m.chunk_ids()})
    assert fresh_client.post(f"/v1/jobs/{job}/verify").json()["ok"] is True

    # A committed step is closed to changes.
    other = manifest(job, step, 0, world, [tensor(fresh_client, "w", rows=(0, 3), global_rows=6)])
    assert_error(put_manifest(fresh_client, other), 409, "already_committed")


def test_a_rank_outside_the_steps_world_is_not_found(client: httpx.Client, job: str) -> None:
    """(found by a probe: rank 5 of a 1-rank step was 400 invalid_request; there is
    no such manifest, as there is no such step: 404, naming the world size)"""
    sharded_step(client, job, 1, 1)
    assert commit(client, job, 1).json()["state"] == "committed"
    body = assert_error(client.get(manifest_path(job, 1, 5)), 404, "manifest_not_found")
    assert "world size 1" in body["message"] and "\n" not in body["message"]
    assert body["detail"]["world_size"] == 1
    r = client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 5, "step": 1})
    assert "world size 1" in assert_error(r, 404, "manifest_not_found")["message"]
    r = client.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 5})  # (latest: no fallback)
    assert_error(r, 404, "manifest_not_found")
    assert client.get(manifest_path(job, 1, 0)).status_code == 200

def test_manifest_is_immutable_before_commit(client: httpx.Client, job: str) -> None:
    first = manifest(job, 3, 0, 2, [tensor(client, "w", rows=(0, 1), global_rows=2)])
    assert put_manifest(client, first).status_code == 201
    second = manifest(job, 3, 0, 2, [tensor(client, "w", rows=(0, 1), global_rows=2)])
    assert_error(put_manifest(client, second), 409, "conflict")


def test_unfinished_step_stays_pending_across_restart(
    fresh_client: httpx.Client, server: ServerProcess
) -> None:
    job = "pending-job"
    sharded_step(fresh_client, job, 1, 4)
    assert commit(fresh_client, job, 1).json()["state"] == "committed"
    for rank in range(3):  # rank 3 of step 2 never sends its manifest
        e = tensor(fresh_client, "w", rows=(rank, rank + 1), global_rows=4)
        assert put_manifest(fresh_client, manifest(job, 2, rank, 4, [e])).status_code == 201
    r = commit(fresh_client, job, 2)
    assert r.status_code == 200
    assert r.json() == {
        "state": "pending",
        "job": job,
        "step": 2,
        "world_size": 4,
        "missing_ranks": [3],
        "record": None,
    }

    def check() -> None:
        assert fresh_client.get(f"/v1/jobs/{job}/latest").json() == {"job": job, "step": 1}
        steps = {s["step"]: s for s in fresh_client.get(f"/v1/jobs/{job}/steps").json()["steps"]}
        assert steps[1]["committed"] and steps[1]["is_latest"]
        assert not steps[2]["committed"] and not steps[2]["is_latest"]
        assert steps[2]["ranks_present"] == 3 and steps[2]["world_size"] == 4
        assert_error(fresh_client.get(f"/v1/jobs/{job}/steps/2"), 409, "not_committed")
        assert_error(fresh_client.get(manifest_path(job, 2, 0)), 409, "not_committed")

    check()
    server.restart()
    check()
    assert "Finished server process" in server.log()  # the SIGTERM shut it down cleanly
    assert commit(fresh_client, job, 2).json()["missing_ranks"] == [3]


def _two_ranks(client: httpx.Client, case: str) -> tuple[list[TensorEntry], list[TensorEntry]]:
    g = 4  # global rows of "w"
    if case == "tiling_gap":
        return (
            [tensor(client, "w", rows=(0, 1), global_rows=g)],
            [tensor(client, "w", rows=(2, 4), global_rows=g)],
        )
    if case == "tiling_overlap":
        return (
            [tensor(client, "w", rows=(0, 3), global_rows=g)],
            [tensor(client, "w", rows=(2, 4), global_rows=g)],
        )
    if case == "dtype_mismatch":
        return (
            [tensor(client, "w", rows=(0, 2), global_rows=g)],
            [tensor(client, "w", rows=(2, 4), global_rows=g, dtype="int32")],
        )
    if case == "shape_mismatch":
        return (
            [tensor(client, "w", rows=(0, 2), global_rows=g)],
            [tensor(client, "w", rows=(2, 4), global_rows=g + 1)],
        )
    assert case == "replica_mismatch"
    return (
        [tensor(client, "w", rows=(0, g), global_rows=g, placement="replicated")],
        [tensor(client, "w", rows=(0, g), global_rows=g, placement="replicated")],
    )


@pytest.mark.parametrize(
    "case",
    ["tiling_gap", "tiling_overlap", "dtype_mismatch", "shape_mismatch", "replica_mismatch"],
)
def test_ranks_that_disagree_do_not_commit(client: httpx.Client, job: str, case: str) -> None:
    sharded_step(client, job, 1, 2)
    assert commit(client, job, 1).json()["state"] == "committed"
    rank0, rank1 = _two_ranks(client, case)
    for rank, entries in enumerate((rank0, rank1)):
        r = put_manifest(client, manifest(job, 2, rank, 2, entries))
        assert r.status_code == 201, r.text
    assert_error(commit(client, job, 2), 409, case)
    assert_error(commit(client, job, 2), 409, case)  # and again: nothing changed
    assert client.get(f"/v1/jobs/{job}/latest").json()["step"] == 1
    assert_error(client.get(f"/v1/jobs/{job}/steps/2"), 409, "not_committed")


# -- bad input ------------------------------------------------------------------------


BAD_NAMES = [
    ("GET", "/v1/jobs/..%2Fx/steps"),
    ("GET", "/v1/jobs/../x/steps"),
    ("GET", "/v1/jobs/%2E%2E/latest"),
    ("GET", "/v1/jobs/../latest"),
    ("GET", "/v1/jobs/..%2F..%2F..%2Fetc/latest"),
    ("GET", "/v1/jobs/.hidden/steps"),
    ("GET", "/v1/jobs/" + "a" * 200 + "/steps"),
    ("GET", "/v1/jobs/a%00b/steps"),
    ("GET", "/v1/jobs/a%20b/steps"),
    ("PUT", "/v1/jobs/..%2Fx/steps/1/ranks/0"),
    ("PUT", "/v1/jobs/%2E%2E/steps/1/ranks/0"),
    ("PUT", "/v1/jobs/" + "a" * 200 + "/steps/1/ranks/0"),
    ("POST", "/v1/jobs/%2E%2E/steps/1/commit"),
    ("GET", "/v1/chunks/" + "z" * 64),
    ("GET", "/v1/chunks/" + "A" * 64),
    ("GET", "/v1/chunks/" + "a" * 63),
    ("PUT", "/v1/chunks/..%2F..%2Fescape"),
    ("PUT", "/v1/chunks/%2E%2E"),
    ("PUT", "/v1/chunks/" + "g" * 64),
    ("HEAD", "/v1/chunks/xyz"),
    ("GET", "/v1/jobs/j/steps/-1"),
    ("GET", "/v1/jobs/j/steps/1000000000000000"),
    ("GET", "/v1/jobs/j/steps/" + "9" * 40),
    ("GET", "/v1/jobs/j/steps/" + "9" * 5000),
    ("GET", "/v1/jobs/j/steps/1.5"),
    ("GET", "/v1/jobs/j/steps/abc"),
    ("PUT", "/v1/jobs/j/steps/-1/ranks/0"),
    ("GET", "/v1/jobs/j/steps/1/ranks/-1"),
    ("GET", "/v1/jobs/j/steps/1/ranks/x"),
    ("POST", "/v1/jobs/j/steps/-3/commit"),
    ("POST", "/v1/jobs/j/verify?step=-1"),
    ("POST", "/v1/jobs/j/verify?step=abc"),
]


def test_bad_names_get_a_coded_4xx_and_never_escape(shared_server: ServerProcess) -> None:
    # The shared server's folder holds its store and its log, as a test's own would:
    # compared before and after, as its log only from here.
    folder = Path(shared_server.store).parent
    before = files_under(folder) - {shared_server.log_path}
    logged = len(shared_server.log())
    for method, path in BAD_NAMES:
        body = b'{"x": 1}' if method in ("PUT", "POST") else None
        status, content = raw(shared_server, method, path, JSON if body else None, body)
        where = (method, path[:80], status, content[:200])
        assert status in (400, 404), where
        if method != "HEAD":
            code = httpx.Response(status, content=content).json()["code"]
            assert code == ("invalid_name" if status == 400 else "not_found"), where
    assert files_under(folder) - {shared_server.log_path} == before
    assert "Traceback" not in shared_server.log()[logged:]


def test_malformed_manifest_is_400(client: httpx.Client, job: str) -> None:
    cases = [
        (b"", "invalid_document"),
        (b"{", "invalid_document"),
        (b"[]", "invalid_document"),
        (b"{}", "invalid_document"),
        (b'{"format": "ckptd.rank_manifest", "version": 99}', "unsupported_format"),
        (b"\xff\xfe", "invalid_document"),
        (b'{"format": "ckptd.rank_manifest", "version": 1, "job": 5}', "invalid_document"),
    ]
    for body, code in cases:
        r = client.put(manifest_path(job, 1, 0), content=body, headers=JSON)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == code, (body, r.text)


def test_manifest_must_match_its_path(fresh_client: httpx.Client) -> None:
    m = manifest("j", 1, 0, 2, [tensor(fresh_client, "w", rows=(0, 1), global_rows=2)])
    for path in (manifest_path("k", 1, 0), manifest_path("j", 2, 0), manifest_path("j", 1, 1)):
        r = fresh_client.put(path, content=m.canonical(), headers=JSON)
        assert_error(r, 400, "invalid_request")
    # Nothing was stored (the whole job list: its own server).
    assert fresh_client.get("/v1/jobs").json() == {"jobs": []}
    evil = m.model_copy(update={"job": "../x"})
    r = fresh_client.put(manifest_path("j", 1, 0), content=evil.canonical(), headers=JSON)
    assert_error(r, 400, "invalid_name")


def test_manifest_over_the_limit_is_413(shared_server: ServerProcess, job: str) -> None:
    limit = knobs.max_manifest_bytes()
    status, body = raw(
        shared_server, "PUT", manifest_path(job, 1, 0), {"Content-Length": str(limit + 1), **JSON}
    )
    assert status == 413 and b'"too_large"' in body


def test_commit_body_is_optional_and_checked(client: httpx.Client, job: str) -> None:
    sharded_step(client, job, 1, 1)
    r = client.post(f"/v1/jobs/{job}/steps/1/commit", content=b"{oops", headers=JSON)
    assert_error(r, 400, "invalid_request")
    assert_error(commit(client, job, 1, meta=[1, 2]), 400, "invalid_request")
    r = client.post(f"/v1/jobs/{job}/steps/1/commit", content=b'{"meta": {"x": NaN}}', headers=JSON)
    assert r.status_code == 400, r.text
    assert client.post(f"/v1/jobs/{job}/steps/1/commit", json={}).json()["state"] == "committed"


def test_unknown_routes_and_methods_answer_json(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    r = client.delete("/v1/jobs")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"



def _shadowed(doc: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(method, fixed path, allowed methods) of each fixed route whose path a route
    with a parameter there matches too (``/v1/chunks/missing`` and ``/{id}``), for
    each method that only the parameter's route takes."""
    paths = {p: {m.upper() for m in ops} for p, ops in doc["paths"].items()}
    for fixed, allowed in paths.items():
        for other, methods in paths.items():
            pattern = "^" + re.sub(r"\{[^/]+?\}", "[^/]+", other) + "$"
            if fixed.count("{") < other.count("{") and re.match(pattern, fixed):
                for method in sorted(methods - allowed):
                    yield method, fixed, ", ".join(sorted(allowed))


def test_a_fixed_route_is_never_read_as_a_parameter(client: httpx.Client) -> None:
    """(found by a probe: GET /v1/chunks/missing, a POST route, was answered 400
    invalid_name, read as a chunk id "missing")"""
    shadowed = list(_shadowed(client.get("/openapi.json").json()))
    assert ("GET", "/v1/chunks/missing", "POST") in shadowed, shadowed
    for method, path, allowed in shadowed:
        r = client.request(method, path, content=b"x" if method == "PUT" else None)
        assert r.status_code == 405, (method, path, r.text)
        assert r.headers["allow"] == allowed
        if method != "HEAD":
            body = assert_error(r, 405, "method_not_allowed")
            assert allowed in body["message"] and "\n" not in body["message"], body
    assert_error(client.get("/v1/chunks/notahash"), 400, "invalid_name")  # still an id
    assert_error(client.get("/v1/chunks/" + "0" * 64), 404, "chunk_not_found")

# -- auth -----------------------------------------------------------------------------


# Open without the token: health and liveness, the dashboard page (it holds no data; its script
# fetches /v1/overview with the token) and /metrics (CKPTD_METRICS_TOKEN_REQUIRED
# closes it).
OPEN_ROUTES = {"/healthz", "/livez", "/", "/metrics"}


def _every_route(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    values = {"{job}": "j", "{step}": "1", "{rank}": "0", "{id}": chunk_id(b"x"),
              "{name}": "t"}
    for path, ops in doc["paths"].items():
        for method in ops:
            if path in OPEN_ROUTES:
                continue
            for k, v in values.items():
                path = path.replace(k, v)
            yield method.upper(), path


def test_token_guards_every_route_but_health(token_server: ServerProcess) -> None:
    anonymous = httpx.Client(base_url=token_server.url, timeout=30.0)
    doc = anonymous.get("/openapi.json").json()
    routes = list(_every_route(doc))
    # 23 (the step plan too), the lifecycle's 12, GET /v1/cluster and POST /v1/chunks/read
    assert len(routes) == 37
    for auth in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret-token"},
        {"Authorization": "Bearer s3cret-token-and-more"},
        {"Authorization": "Basic czNjcmV0LXRva2Vu"},
    ):
        for method, path in routes:
            # Bodies that would fail to parse: the token is checked first anyway.
            r = anonymous.request(
                method,
                path,
                headers={**auth, **JSON},
                content=b"{not json" if method in ("PUT", "POST") else None,
            )
            assert r.status_code == 401, (method, path, auth, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
            if method != "HEAD":
                assert r.json()["code"] == "unauthorized"

    assert anonymous.get("/healthz").status_code == 200
    assert anonymous.get("/livez").status_code == 200
    anonymous.close()
    with httpx.Client(base_url=token_server.url, headers=token_server.headers()) as client:
        cid = put_chunk(client, b"hello")
        assert client.get(f"/v1/chunks/{cid}").content == b"hello"
        assert client.get("/v1/jobs").status_code == 200
        r = client.post("/v1/chunks/missing", json={"ids": [cid]})
        assert r.json() == {"missing": [], "in_flight": []}


@pytest.mark.parametrize("flag", [[], ["--no-access-log"]])
def test_the_access_log_can_be_turned_off(tmp_path: Path, flag: list[str]) -> None:
    from tests.conftest import ServerProcess

    srv = ServerProcess(store=tmp_path / "store", extra_args=flag)
    srv.start()
    try:
        data = b"logged or not"
        assert httpx.put(f"{srv.url}/v1/chunks/{chunk_id(data)}", content=data).status_code == 201
    finally:
        srv.stop()
    logged = f'"PUT /v1/chunks/{chunk_id(data)} HTTP/1.1" 201' in srv.log_path.read_text()
    assert logged == (not flag)
