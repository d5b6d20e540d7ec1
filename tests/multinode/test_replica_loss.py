"""The job's home replica lost mid-save, twice in one run: first its host
unplugged (nothing answers, nothing resets) during the save of step 100, then
the next home's process killed (its connections reset at once) during the save
of step 200. Three ``ckptd serve`` replicas over one store, each on a host of its
own, a 2 x 2-rank torchrun job: each save goes on through a replica left,
each commits seconds after the loss (not after a request timeout), training
stalls a few seconds at most (the next save waits for the one before), and the
job ends bitwise equal to an undisturbed run, with no error at ``close()``."""

from __future__ import annotations

import signal
import time

import pytest

from ckptd.cluster import home, job_key
from tests.multinode.hosts import Cluster, Host
from tests.multinode.jobs import Job, Replica, replicas
from tests.multinode.outcomes import (
    JOB,
    Outcome,
    assert_bitwise,
    assert_one_launch_per_step,
    expect_steps,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]

STALL_LIMIT = 10.0  # seconds a rank may go between two steps while a replica is lost
COMMIT_LIMIT = 15.0  # seconds from a replica's loss to the commit of the step it was saving


def lose_home_mid_save(job: Job, live: list[Replica], step: int, how: str,
                       via: Host) -> tuple[Replica, float]:
    """Freezes the job's home replica before ``step`` is saved (a stopped process
    answers nothing, as a vanished host would not), waits until every rank has
    handed the save over, checks it is not committed, then loses the replica for
    good: ``killed`` (connections reset) or ``unplugged`` (its cable pulled, the
    process stopped behind it). The replica lost, and when."""
    lost = next(r for r in live if r.url == home(job_key(JOB), [r.url for r in live]))
    left = next(r for r in live if r is not lost)
    job.wait_event("step", 240, step=step - 5)
    assert lost.proc is not None
    lost.proc.signal(signal.SIGSTOP)
    try:
        job.wait_event("save", 60, count=4, step=step)
        time.sleep(1.0)  # the uploads and the commit are in flight to it now
        steps = left.get(f"/v1/jobs/{JOB}/steps", via=via)["steps"]
        assert not any(s["step"] == step and s["committed"] for s in steps), steps
    finally:
        if how == "killed":
            lost.proc.signal(signal.SIGKILL)
        else:
            lost.host.cut_link()
    live.remove(lost)
    return lost, time.time()


def test_the_home_replica_lost_mid_save_costs_seconds_and_the_job_ends_bitwise(
        cluster: Cluster, undisturbed: Outcome) -> None:
    live = replicas(cluster, 3)
    urls = [r.url for r in live]
    node1, node2 = cluster.add_host("node1"), cluster.add_host("node2")
    job = Job("replicas", cluster.dir / "out", urls, worker_args=["--mark-steps", "95,195"])
    job.start(node1)
    job.start(node2)
    _, unplugged_at = lose_home_mid_save(job, live, 100, "unplugged", node1)
    _, killed_at = lose_home_mid_save(job, live, 200, "killed", node1)
    results = job.wait(300)

    (survivor,) = live
    assert_bitwise(results, undisturbed.results)
    stalls = {r["rank"]: round(r["slowest_gap"], 2) for r in results}
    assert max(stalls.values()) <= STALL_LIMIT, stalls
    assert all(r["close"]["failed"] == 0 for r in results), results
    launches = assert_one_launch_per_step(survivor, node1, world=4)
    expect_steps(survivor, node1, launches, {0, 100, 200})
    for step, lost_at in ((100, unplugged_at), (200, killed_at)):
        record = survivor.get(f"/v1/jobs/{JOB}/steps/{step}", via=node1)
        took = record["committed_at"] - lost_at
        assert -1.0 < took <= COMMIT_LIMIT, (step, took)  # after the loss, soon after
