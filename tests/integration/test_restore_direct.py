"""Reads that skip the server (issue 21, item 3): over an S3-compatible store the
restore plan carries presigned GET URLs of the rank's chunks, and the rank reads
them from the object store, verifying each; the server carries no restore bytes.

Against moto's S3 server behind a front that checks presigned URLs as S3 does
(signature and expiry: moto checks neither; ``tests/store/moto_presigned.py``),
and a real ``ckptd serve`` over it. Covered: the bytes' source, the plan's scope,
an expired URL (a skewed object store), bytes bad on the way (fall back to the
server), bytes bad at rest (a typed error, the target untouched), and both knobs."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch

pytest.importorskip("moto.server")
pytest.importorskip("aiobotocore")
boto3 = pytest.importorskip("boto3")

from ckptd.client import Checkpointer  # noqa: E402
from ckptd.errors import ChunkHashMismatch  # noqa: E402
from ckptd.format import chunk_key  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.moto_server import moto_server, s3_env  # noqa: E402
from tests.relay import relay  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

BUCKET = "ckptd-direct"
CHUNK = 256 << 10
KEY_ID, SECRET = "ckptdpresignkey", "ckptd-presign-secret-0123456789"


def aws_env() -> dict[str, str]:
    return s3_env(KEY_ID, SECRET)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto behind the presigned-URL checks, on 127.0.0.1, with one bucket."""
    with moto_server("tests.store.moto_presigned", BUCKET, aws_env(),
                     tmp_path_factory.mktemp("moto")) as url:
        yield url


class S3Server(ServerProcess):
    def base_env(self) -> dict[str, str]:
        return aws_env()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def serve(front: str, prefix: str, tmp_path: Path, **env: str) -> S3Server:
    srv = S3Server(store=f"s3://{BUCKET}/{prefix}?endpoint={front}", log_dir=tmp_path, env=env)
    srv.start(timeout=60)
    return srv


@pytest.fixture
def server(front: str, prefix: str, tmp_path: Path) -> Iterator[S3Server]:
    srv = serve(front, prefix, tmp_path)
    try:
        yield srv
    finally:
        srv.stop()
        httpx.post(f"{front}/__front/clock?skew=0")
        httpx.post(f"{front}/__front/redirect?on=0")


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g),  # 5 chunks of 256 KiB
            "b": torch.randn(1000, generator=g), "step": 7}


def zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k]
               for k in b)


def saved(server: ServerProcess, job: str, seed: int = 1) -> dict[str, Any]:
    state = make_state(seed)
    with Checkpointer(server.url, job, chunk_size=CHUNK, serve_peers=False) as ckpt:
        ckpt.save(1, state).wait(timeout=120)
    return state


def restore(server: ServerProcess, job: str, target: dict[str, Any]) -> Any:
    with Checkpointer(server.url, job, chunk_size=CHUNK, serve_peers=False) as ckpt:
        return ckpt.restore(target, tiers=("store",))


def first_chunks(server: ServerProcess, job: str) -> list[str]:
    """The chunk ids of the first entry of rank 0's manifest of step 1."""
    plan = httpx.get(f"{server.url}/v1/jobs/{job}/restore-plan",
                     params={"rank": 0, "step": 1}).json()
    entry = max(plan["manifest"]["entries"], key=lambda e: len(e["chunks"]))
    return list(entry["chunks"])


def chunk_lines(server: ServerProcess, since: int) -> list[str]:
    """The server's access-log lines of chunk reads after ``since`` characters."""
    return [line for line in server.log()[since:].splitlines()
            if "/v1/chunks/" in line and ("GET" in line or "/read" in line)]


def test_a_restore_reads_every_chunk_from_the_object_store(server: S3Server, front: str
                                                          ) -> None:
    state = saved(server, "direct")
    before = httpx.get(f"{front}/__front/count").json()["presigned_gets"]
    mark = len(server.log())
    target = zeros(state)
    result = restore(server, "direct", target)
    assert same(target, state)
    assert result.bytes_from.get("object", 0) == result.bytes_fetched > 0
    assert result.bytes_from.get("store", 0) == 0 and not result.problems
    got = httpx.get(f"{front}/__front/count").json()["presigned_gets"] - before
    assert got == result.chunks  # each chunk once, through its presigned URL
    assert chunk_lines(server, mark) == []  # the server carried none of them


def test_the_plan_signs_only_the_ranks_own_chunks(server: S3Server, front: str) -> None:
    with Checkpointer(server.url, "scoped", rank=0, world_size=2, chunk_size=CHUNK,
                      serve_peers=False) as mine, \
            Checkpointer(server.url, "scoped", rank=1, world_size=2, chunk_size=CHUNK,
                         serve_peers=False) as other:
        # Rank-private entries, different bytes: rank 1's chunks are not rank 0's.
        handles = [mine.save(1, make_state(2), local=["w", "b"]),
                   other.save(1, make_state(3), local=["w", "b"])]
        for handle in handles:
            handle.wait(timeout=120)
    plan = httpx.get(f"{server.url}/v1/jobs/scoped/restore-plan",
                     params={"rank": 0, "step": 1}).json()
    mine = {cid for e in plan["manifest"]["entries"] for cid in e["chunks"]}
    assert set(plan["reads"]) == mine and plan["reads_expire_in"] == 900
    for cid, url in plan["reads"].items():
        assert urlsplit(url).path.endswith("/" + chunk_key(cid))
        assert SECRET not in url and "X-Amz-Signature=" in url
    # A URL reads its own object and no other: moved to another key, it is refused.
    cid, url = next(iter(plan["reads"].items()))
    other = next(c for c in mine if c != cid)
    moved = url.replace(cid, other)
    assert httpx.get(url).status_code == 200
    assert httpx.get(moved).status_code == 403


def test_an_expired_url_falls_back_to_the_server(server: S3Server, front: str) -> None:
    state = saved(server, "expired")
    httpx.post(f"{front}/__front/clock?skew=3600")  # every URL looks an hour old
    target = zeros(state)
    result = restore(server, "expired", target)
    assert same(target, state)
    assert result.bytes_from.get("store", 0) == result.bytes_fetched > 0
    refused = [p for p in result.problems if p.tier == "object"]
    assert refused and all(p.kind == "failed" for p in refused)
    assert "Request has expired" in refused[0].message


def test_the_command_line_says_a_refused_object_store_in_one_line(
        server: S3Server, front: str, tmp_path: Path) -> None:
    """(Found by a probe.) ``ckptd restore`` printed a Python repr per chunk an object
    store refused (``ChunkProblem(chunk='...', tier='object', ...)``), the source
    called a peer."""
    saved(server, "expired-cli")
    httpx.post(f"{front}/__front/clock?skew=3600")
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "restore", "--job", "expired-cli", "--rank", "0",
         "--to", str(tmp_path / "cache"), "--url", server.url],
        capture_output=True, text=True, timeout=120, env=aws_env())
    out = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ChunkProblem(" not in out and "peer http" not in out, out
    short = [line for line in done.stdout.splitlines() if "fell short" in line]
    assert len(short) == 1 and "object store" in short[0], done.stdout
    assert re.search(r"object store: failed for \d+ chunks? \(", out), out


def test_a_redirect_stops_direct_reads_and_the_server_serves(
        server: S3Server, front: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by review.) A redirect is not followed (a URL is signed for one host)
    and says every URL of the plan is for the wrong endpoint: after the first one
    the rest go to the server, not each to the object store first."""
    state = saved(server, "moved")
    httpx.post(f"{front}/__front/redirect?on=1")
    monkeypatch.setenv("CKPTD_RESTORE_CONCURRENCY", "1")  # (one chunk at a time)
    target = zeros(state)
    result = restore(server, "moved", target)
    assert same(target, state)
    assert result.bytes_from.get("store", 0) == result.bytes_fetched > 0
    tried = [p for p in result.problems if p.tier == "object"]
    assert len(tried) == 1 and "307" in tried[0].message, result.problems
    assert result.chunks > 1


def test_an_object_store_host_this_host_cannot_resolve_is_tried_once(
        server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by a deploy review.) The server signs URLs on its own S3 endpoint, a
    name its clients may not resolve (compose's ``minio``): every chunk went to that
    host first, 125 chunks' failures in 20 s where the server alone took 0.4 s. A
    name that does not resolve stops direct reads, as a refused connection does."""
    state = saved(server, "unresolved")

    def elsewhere(answer: Any) -> Any:
        if isinstance(answer, dict) and answer.get("reads"):
            answer["reads"] = {cid: "http://ckptd-nowhere.invalid:9000" + urlsplit(url).path
                               for cid, url in answer["reads"].items()}
        return answer

    monkeypatch.setenv("CKPTD_RESTORE_CONCURRENCY", "1")  # (one chunk at a time)
    with relay(server.url, change=elsewhere) as url:
        target = zeros(state)
        with Checkpointer(url, "unresolved", chunk_size=CHUNK, serve_peers=False) as ckpt:
            result = ckpt.restore(target, tiers=("store",))
    assert same(target, state)
    assert result.bytes_from.get("store", 0) == result.bytes_fetched > 0
    tried = [p for p in result.problems if p.tier == "object"]
    assert len(tried) == 1 and "ckptd-nowhere.invalid" in tried[0].message, result.problems
    assert result.chunks > 1


def test_bytes_bad_on_the_way_are_taken_from_the_server(server: S3Server, front: str) -> None:
    state = saved(server, "wire")
    chunks = first_chunks(server, "wire")
    bad = chunks[1]
    httpx.post(f"{front}/__front/tamper", params={"key": bad})
    target = zeros(state)
    result = restore(server, "wire", target)
    assert same(target, state)
    assert [(p.tier, p.kind, p.chunk) for p in result.problems] == [("object", "mismatch", bad)]
    assert result.bytes_from["store"] == CHUNK
    assert result.bytes_from["object"] == result.bytes_fetched - CHUNK


def test_bytes_bad_at_rest_are_a_hash_mismatch_and_leave_the_target(
        server: S3Server, front: str, prefix: str) -> None:
    state = saved(server, "rest")
    chunks = first_chunks(server, "rest")
    bad = chunks[0]
    s3 = boto3.client("s3", endpoint_url=front, aws_access_key_id=KEY_ID,
                      aws_secret_access_key=SECRET, region_name="us-east-1")
    key = f"{prefix}/{chunk_key(bad)}"
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[100] ^= 1
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))  # the stored object damaged
    target = zeros(state)
    with pytest.raises(ChunkHashMismatch) as info:
        restore(server, "rest", target)
    kinds = {(p["tier"], p["kind"]) for p in info.value.detail["problems"]}
    assert {("object", "mismatch"), ("store", "mismatch")} <= kinds
    assert same(target, zeros(state))  # atomic: nothing of it reached the target


def test_direct_reads_can_be_turned_off_on_either_side(
        front: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(front, prefix, tmp_path, CKPTD_PRESIGNED_READS="false")
    try:
        state = saved(srv, "off")
        plan = httpx.get(f"{srv.url}/v1/jobs/off/restore-plan",
                         params={"rank": 0, "step": 1}).json()
        assert not plan.get("reads")
        target = zeros(state)
        result = restore(srv, "off", target)
        assert same(target, state) and result.bytes_from.get("object", 0) == 0
    finally:
        srv.stop()
    srv = serve(front, prefix, tmp_path)
    try:
        monkeypatch.setenv("CKPTD_DIRECT_READS", "0")
        target = zeros(state)
        result = restore(srv, "off", target)
        assert same(target, state) and result.bytes_from.get("object", 0) == 0
        assert result.bytes_from["store"] == result.bytes_fetched
    finally:
        srv.stop()
