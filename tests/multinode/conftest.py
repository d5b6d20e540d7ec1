"""Simulated hosts for multi-node tests (see hosts.py): ``cluster`` gives a
switch to put hosts on, torn down after the test whatever happened (and at exit,
and with the test process itself if it is killed). Without root, or without
namespaces, every test here skips with one line saying why."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multinode.hosts import Cluster, unavailable_reason
from tests.multinode.jobs import Job, replicas
from tests.multinode.outcomes import Outcome

ROOT = Path(__file__).resolve().parents[2]

_reason: list[str | None] = []


def hosts_unavailable() -> str | None:
    """Why simulated hosts cannot run here, asked once per session."""
    if not _reason:
        _reason.append(unavailable_reason())
    return _reason[0]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A switch with no hosts yet: ``cluster.add_host("node1")``. Torn down when
    the test ends, fails or is interrupted (Ctrl-C, pytest-timeout)."""
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    net = Cluster(tmp_path, cwd=ROOT)
    try:
        yield net
    finally:
        net.close()


def no_step_time_snapshots(where: Path) -> dict[str, str]:
    """The test worker's environment for a health policy that never asks for a
    snapshot because a step was slow (a loaded host's steps are): a run whose
    committed steps a test relies on commits only the steps it saves."""
    policy = where / "no-step-time-snapshots.toml"
    policy.write_text('[signals.step_time_ratio]\ndegraded = "off"\ncritical = "off"\n')
    return {"CKPTD_TEST_HEALTH_POLICY": str(policy)}


@pytest.fixture(scope="session")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The README's loop on 2 nodes x 2 ranks with nothing going wrong: what every
    disturbed run of the same steps must end with, bitwise. Its store as it was
    with step 100 committed and nothing newer is kept (``Outcome.store_at_100``):
    the run is held at step 150 while it is copied, which changes no result."""
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("undisturbed")
    with Cluster(base, cwd=ROOT) as net:
        (server,) = replicas(net)
        nodes = [net.add_host("node1"), net.add_host("node2")]
        # No snapshot the probe asks for between 100 and the copy: on a loaded host a
        # slow step asked for one (step 133, committed before the copy), and the
        # scale-in went on from it, not from 100 (failed 1 of 4 full runs).
        job = Job("undisturbed", net.dir / "out", [server.url],
                  worker_args=["--pause-host", "node2", "--pause-at", "150"],
                  env=no_step_time_snapshots(net.dir))
        for node in nodes:
            job.start(node)
        job.wait_event("paused", 300)
        kept = base / "store-at-100"
        shutil.copytree(server.store, kept)
        job.release()
        return Outcome.of(job, job.wait(300), store_at_100=kept)
