"""The lean chunk route (``ckptd.server.ingest``, ``direct_chunk_app``) tells a
caller what FastAPI's chunk routes tell it, no more: ``?via=route`` (a query) is
not taken by the lean route, so each test asks both ways and compares."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from ckptd.hashing import chunk_id
from ckptd.tokens import create_token
from tests.conftest import ServerProcess

# "" is the lean route under ckptd serve; a query sends the request through FastAPI.
PATHS = ("", "?via=route")


@pytest.mark.slow
def test_a_store_failure_on_a_chunk_tells_a_tenant_no_bucket_or_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store backend's own error names the bucket, the prefix and the endpoint:
    the operator's to read (docs/SECURITY.md, "Health"); a job's token gets "the
    store failed on KEY", on the lean route as on FastAPI's."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    from tests.conftest import free_port
    from tests.store.test_s3 import _OneRequestAtATime

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true"),
                        ("AWS_CONFIG_FILE", "/nonexistent"), ("AWS_MAX_ATTEMPTS", "1"),
                        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"),
                        # no retries: ckptd's own setting, which AWS_MAX_ATTEMPTS does not
                        # override (each failing request waited ~8 s of backoff)
                        ("CKPTD_RETRIES", "0")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    s3 = moto_server.ThreadedMotoServer("127.0.0.1", free_port(), verbose=False)
    s3.start()
    s3._server.app = _OneRequestAtATime(s3._server.app)
    host, port = s3.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="infra-bucket-name")
    tokens = tmp_path / "tokens.json"
    alpha = {"Authorization": f"Bearer {create_token(tokens, 'alpha', 'write')[0]}"}
    operator = {"Authorization": "Bearer the-operator"}
    srv = ServerProcess(store=tmp_path / "unused", token="the-operator",
                        extra_args=["--store", f"s3://infra-bucket-name/secret-prefix"
                                    f"?endpoint={endpoint}", "--tokens-file", str(tokens)])
    data, known = os.urandom(100_000), os.urandom(1000)
    cid = chunk_id(data)
    stopped = False
    try:
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            # A chunk alpha sent: alpha may read it, so its GET asks the store.
            r = c.put(f"/v1/chunks/{chunk_id(known)}", content=known, headers=alpha)
            assert r.status_code == 201, r.text
            s3.stop()
            stopped = True
            for via in PATHS:
                for r in (c.put(f"/v1/chunks/{cid}{via}", content=data, headers=alpha),
                          c.get(f"/v1/chunks/{chunk_id(known)}{via}", headers=alpha)):
                    what = f"{r.request.method} {via or 'lean'}: {r.text}"
                    assert r.status_code == 500 and r.json()["code"] == "store_error", what
                    for secret in ("infra-bucket-name", "secret-prefix", str(port), "s3://"):
                        assert secret not in r.text, what
                    assert r.json()["message"].startswith("the store failed"), what
                # The operator reads the whole error.
                r = c.put(f"/v1/chunks/{cid}{via}", content=data, headers=operator)
                assert r.status_code == 500 and "infra-bucket-name" in r.text, r.text
    finally:
        srv.stop()
        if not stopped:
            s3.stop()
