"""``ckptd status`` over several replicas shows every job as its home replica sees
it (only the home holds a job's heartbeats)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ckptd.client.health.heartbeat import Heartbeat
from ckptd.cluster import home, job_key
from tests.cluster.conftest import Cluster, s3_env


@pytest.mark.slow
def test_status_merges_every_replicas_jobs(lease_cluster: Cluster) -> None:
    a, b = lease_cluster.add(), lease_cluster.add()
    urls = [a.url, b.url]
    # Two jobs with different homes.
    jobs = {home(job_key(f"job{i}"), urls): f"job{i}" for i in range(40)}
    assert len(jobs) == 2
    beats = [Heartbeat(lease_cluster.urls, job, rank, 2, interval=0.5)
             for job in jobs.values() for rank in range(2)]
    try:
        for hb in beats:
            assert hb.beat_now() is not None
            hb.start()  # and on, every 0.5 s: alive while status looks
        for url, job in jobs.items():  # each job's heartbeats went to its home only
            other = next(u for u in urls if u != url)
            assert lease_cluster.replicas[urls.index(url)].metric("ckptd_heartbeats_total") > 0
            assert job not in _status(other + ",", single=True)
        out = _status(a.url)  # given one replica, it learns the other
        for job in jobs.values():
            assert job in out
        assert out.count("alive") == 4, out
    finally:
        for hb in beats:
            hb.stop()


def _status(url: str, *, single: bool = False) -> str:
    env = {**s3_env(), "COLUMNS": "200"}
    if single:
        env["CKPTD_CLUSTER_REFRESH"] = "0"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--url", url.rstrip(",")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, (out.stdout, out.stderr, time.monotonic() - started)
    return out.stdout
