"""``/livez`` answers while the store is down, ``/healthz`` does not: a liveness
probe on ``/healthz`` restarted every replica for an object store's outage, and a
restarted server, which cannot open the store, went into the orchestrator's
growing back-off (deploy/kubernetes probes ``/livez`` for liveness)."""

from __future__ import annotations

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
