"""A server whose object store is down. ``/livez`` answers, ``/healthz`` does not: a
liveness probe on ``/healthz`` restarted every replica for an object store's outage,
and a restarted server, which cannot open the store, went into the orchestrator's
growing back-off (deploy/kubernetes probes ``/livez`` for liveness). A command
through it says the server could not use its store, not the store's endpoint as
its own caller's problem."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ckptd.api import HEALTHZ, LIVEZ
from tests.cluster.conftest import BUCKET, Replica
from tests.moto_server import moto_server, s3_env


def test_livez_answers_while_the_store_is_down(tmp_path: Path) -> None:
    with moto_server("tests.cluster.moto_s3", BUCKET, s3_env(), tmp_path) as endpoint:
        replica = Replica(f"s3://{BUCKET}/livez?endpoint={endpoint}", tmp_path).start()
        try:
            assert httpx.get(replica.url + HEALTHZ, timeout=10).status_code == 200
            assert httpx.get(replica.url + LIVEZ, timeout=10).json()["status"] == "ok"
            moto = endpoint
        except BaseException:
            replica.stop()
            raise
    try:  # (moto is gone)
        deadline = time.monotonic() + 20.0
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            status = httpx.get(replica.url + HEALTHZ, timeout=10).status_code
        assert status == 503, f"/healthz still {status} with {moto} gone"
        live = httpx.get(replica.url + LIVEZ, timeout=5)
        assert live.status_code == 200 and live.json()["status"] == "ok", live.text
        assert "store" not in live.json()
    finally:
        replica.stop()


def test_a_command_says_the_server_could_not_use_its_store(tmp_path: Path) -> None:
    """(Found by a probe.) ``ckptd ls`` through a server whose S3 endpoint was gone
    said "nothing answered at http://127.0.0.1:<S3's port>: check that this host
    reaches it": the server's words about its own store, read as the caller's."""
    with moto_server("tests.cluster.moto_s3", BUCKET, s3_env(), tmp_path) as endpoint:
        replica = Replica(f"s3://{BUCKET}/down?endpoint={endpoint}", tmp_path).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        env["CKPTD_RETRIES"] = "0"
        done = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--url", replica.url],
                              capture_output=True, text=True, env=env, timeout=120)
    finally:
        replica.stop()
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "Traceback" not in said, said
    assert f"the ckptd server at {replica.url} could not use its store" in said, said
