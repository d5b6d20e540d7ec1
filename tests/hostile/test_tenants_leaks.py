"""Issue 10, item 15: what the server tells callers without a token.

``/healthz`` says ok or not and the version; where the store is needs a token
that sees every job. ``/metrics`` can be closed, and its job labels never come
from requests that anyone could send."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ckptd.tokens import create_token
from tests.conftest import ServerProcess


def test_healthz_shows_details_only_with_a_token(token_server: ServerProcess) -> None:
    r = httpx.get(f"{token_server.url}/healthz", timeout=10)
    assert r.status_code == 200
    assert set(r.json()) == {"status", "version"}
    assert r.json()["status"] == "ok"
    assert str(token_server.store) not in r.text
    r = httpx.get(f"{token_server.url}/healthz", headers={"Authorization": "Bearer wrong"})
    assert set(r.json()) == {"status", "version"}
    r = httpx.get(f"{token_server.url}/healthz", headers=token_server.headers(), timeout=10)
    assert str(token_server.store.name) in r.json()["store"]


@pytest.mark.slow
def test_healthz_says_not_ok_when_the_store_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 store (moto's server) that goes away: 503 "not ok", within a bound."""
    import time

    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    from tests.conftest import free_port

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true"),
                        ("AWS_CONFIG_FILE", "/nonexistent"),
                        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"), ("CKPTD_RETRIES", "0")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    from tests.store.test_s3 import _OneRequestAtATime

    s3 = moto_server.ThreadedMotoServer("127.0.0.1", free_port(), verbose=False)
    s3.start()
    # S3's conditional writes are atomic; moto's only one request at a time (the
    # server checks its store's conditions at start).
    s3._server.app = _OneRequestAtATime(s3._server.app)  # type: ignore[union-attr]
    host, port = s3.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="health")
    srv = ServerProcess(store=tmp_path / "unused", token="t",
                        extra_args=["--store", f"s3://health/p?endpoint={endpoint}"])
    stopped = False
    try:
        srv.start()
        assert httpx.get(f"{srv.url}/healthz", timeout=10).json()["status"] == "ok"
        s3.stop()
        stopped = True
        deadline = time.monotonic() + 20
        while True:
            t0 = time.monotonic()
            r = httpx.get(f"{srv.url}/healthz", timeout=20)
            assert time.monotonic() - t0 < 10  # answered within a bound, not hung
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 503 and r.json() == {"status": "not ok",
                                                     "version": r.json()["version"]}
    finally:
        srv.stop()
        if not stopped:
            s3.stop()


def _job_labels(text: str) -> set[str]:
    return {line.split('job="', 1)[1].split('"', 1)[0]
            for line in text.splitlines() if 'job="' in line and not line.startswith("#")}


def test_open_server_metrics_get_no_labels_from_requests_alone(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for n in range(15):  # what a fuzzer sends: made-up jobs
            c.post(f"/v1/jobs/fuzz-{n}/ranks/0/heartbeat", json={"world_size": 1})
            c.post(f"/v1/jobs/snap-{n}/snapshot-requests", json={"rank": 0, "reason": "x"})
        labels = _job_labels(c.get("/metrics").text)
    assert not labels, labels


def test_metrics_can_need_a_token_on_every_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens.json"
    everything = create_token(path, "*", "read")[0]
    one_job = create_token(path, "alpha", "admin")[0]
    monkeypatch.setenv("CKPTD_METRICS_TOKEN_REQUIRED", "true")
    srv = ServerProcess(store=tmp_path / "store", token="root",
                        extra_args=["--tokens-file", str(path)])
    srv.start()
    try:
        url = f"{srv.url}/metrics"
        assert httpx.get(url).status_code == 401
        auth = {"Authorization": f"Bearer {one_job}"}
        r = httpx.post(f"{srv.url}/v1/jobs/alpha/ranks/0/heartbeat", json={"world_size": 1},
                       headers=auth)
        assert r.status_code == 200
        assert httpx.get(url, headers=auth).status_code == 403
        r = httpx.get(url, headers={"Authorization": f"Bearer {everything}"})
        assert r.status_code == 200 and _job_labels(r.text) == {"alpha"}
        assert httpx.get(url, headers=srv.headers()).status_code == 200
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_store_failure_tells_a_tenant_no_bucket_endpoint_or_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 error's message names the bucket, the prefix, the endpoint (and in an
    AccessDenied, the server's cloud identity): the operator's to read, in the log
    and with a token on every job; a job's token gets the key only."""
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
    s3._server.app = _OneRequestAtATime(s3._server.app)  # type: ignore[union-attr]
    host, port = s3.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="infra-bucket-name")
    tokens = tmp_path / "tokens.json"
    alpha = create_token(tokens, "alpha", "read")[0]
    srv = ServerProcess(store=tmp_path / "unused", token="the-operator",
                        extra_args=["--store", f"s3://infra-bucket-name/secret-prefix"
                                    f"?endpoint={endpoint}", "--tokens-file", str(tokens)])
    stopped = False
    try:
        srv.start()
        s3.stop()
        stopped = True
        tenant = httpx.get(f"{srv.url}/v1/jobs/alpha/steps", timeout=60,
                           headers={"Authorization": f"Bearer {alpha}"})
        assert tenant.status_code == 500 and tenant.json()["code"] == "store_error", tenant.text
        for secret in ("infra-bucket-name", "secret-prefix", str(port), "s3://"):
            assert secret not in tenant.text, tenant.text
        assert tenant.json()["detail"] == {"key": "jobs/alpha/steps/"}
        operator = httpx.get(f"{srv.url}/v1/jobs/alpha/steps", timeout=60,
                             headers={"Authorization": "Bearer the-operator"})
        assert operator.status_code == 500 and "infra-bucket-name" in operator.text
        assert "infra-bucket-name" in srv.log()  # the full error, for the operator
    finally:
        srv.stop()
        if not stopped:
            s3.stop()
