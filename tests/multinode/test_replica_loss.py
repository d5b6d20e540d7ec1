"""The job's home replica lost mid-save, two ways: its process killed (its
connections reset at once) and its host unplugged (nothing answers, nothing
resets). Two ``ckptd serve`` replicas over one store, each on a host of its own,
a 2 x 2-rank torchrun job: the save goes on through the other replica, training
stalls a few seconds at most, and the job ends bitwise equal to an undisturbed
run, with no error at ``close()``."""

from __future__ import annotations

import signal
import time

import pytest

from ckptd.cluster import home, job_key
from tests.multinode.hosts import Cluster
from tests.multinode.jobs import Job, replicas
from tests.multinode.outcomes import JOB, Outcome, assert_bitwise, assert_one_launch_per_step

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]

STALL_LIMIT = 10.0  # seconds a rank may go between two steps while a replica is lost


@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_the_home_replica_lost_mid_save_costs_seconds_and_the_job_ends_bitwise(
        cluster: Cluster, undisturbed: Outcome, how: str) -> None:
    both = replicas(cluster, 2)
    lost = next(r for r in both if r.url == home(job_key(JOB), [r.url for r in both]))
    survivor = next(r for r in both if r is not lost)
    node1, node2 = cluster.add_host("node1"), cluster.add_host("node2")
    job = Job(f"replica-{how}", cluster.dir / "out", [r.url for r in both],
              worker_args=["--mark-steps", "195"])
    job.start(node1)
    job.start(node2)
    job.wait_event("step", 240, step=195)
    # Frozen first, so that step 200's uploads and commit are in flight to it (a
    # stopped process answers nothing, as a vanished host would not)...
    assert lost.proc is not None
    lost.proc.signal(signal.SIGSTOP)
    try:
        job.wait_event("save", 60, count=4, step=200)
        time.sleep(1.0)
        steps = survivor.get(f"/v1/jobs/{JOB}/steps", via=node1)["steps"]
        assert not any(s["step"] == 200 and s["committed"] for s in steps), steps
    finally:
        # ...then lost for good: killed (its connections reset), or its cable
        # pulled (nothing comes back, ever) with the process stopped behind it.
        if how == "killed":
            lost.proc.signal(signal.SIGKILL)
        else:
            lost.host.cut_link()
    lost_at = time.time()
    results = job.wait(300)

    assert_bitwise(results, undisturbed.results)
    stalls = {r["rank"]: round(r["slowest_gap"], 2) for r in results}
    assert max(stalls.values()) <= STALL_LIMIT, stalls
    assert all(r["close"]["failed"] == 0 for r in results), results
    launches = assert_one_launch_per_step(survivor, node1, world=4)
    assert set(launches) == {0, 100, 200}
    committed = survivor.get(f"/v1/jobs/{JOB}/steps/200", via=node1)
    assert committed["committed_at"] > lost_at - 1.0, committed  # after the loss, not before
