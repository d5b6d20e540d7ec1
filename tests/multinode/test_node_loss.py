"""A whole node lost from a 2 x 2-rank torchrun job (c10d rendezvous, the
README's loop, one ``ckptd serve`` on a host of its own), each run against an
undisturbed run of the same steps, bitwise:

- the node SIGKILLed with its shared memory, a replacement node joins;
- elastic scale-in (``--nnodes=1:2``): the node dies mid-save, nobody replaces it;
- the node's link cut, the node alive: its ranks stall, the others detect it,
  the job goes on once the link is back."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.multinode.conftest import ROOT, no_step_time_snapshots
from tests.multinode.hosts import Cluster
from tests.multinode.jobs import Job, replicas, wait_until
from tests.multinode.outcomes import (
    JOB,
    Outcome,
    assert_bitwise,
    assert_one_launch_per_step,
    expect_steps,
    restores_after,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]


def test_a_killed_node_is_replaced_and_the_job_ends_bitwise(
        cluster: Cluster, undisturbed: Outcome) -> None:
    (server,) = replicas(cluster)
    node1, node2 = cluster.add_host("node1"), cluster.add_host("node2")
    # node2's first rank stops before step 150 once step 100 is committed: the
    # others wait for it in their next all-reduce, as they would for a dying node.
    # No snapshot the probe asks for: a slow step's snapshot after 100 that never
    # commits (node2 is killed with it in flight) overwrites the survivors' pools, which
    # then hold only part of step 100 and serve none of it (all from the store).
    job = Job("replace", cluster.dir / "out", [server.url],
              worker_args=["--pause-host", "node2", "--pause-at", "150"],
              env=no_step_time_snapshots(cluster.dir))
    job.start(node1)
    job.start(node2)
    job.wait_event("paused", 240)
    killed = time.time()
    node2.kill()  # its processes, its network and its /dev/shm
    node3 = cluster.add_host("node3")
    job.start(node3)
    results = job.wait(300)

    assert_bitwise(results, undisturbed.results)
    assert [r["host"] for r in results] == ["node1", "node1", "node3", "node3"]
    restored = restores_after(job.events(), killed)
    assert [e["rank"] for e in restored] == [0, 1, 2, 3], restored
    for e in restored:
        assert e["step"] == 100 and e["digest"] == undisturbed.saved(100), e
        assert not e["problems"], e
    # The survivors restore from their own pools; the replacement node from the
    # survivors' shared memory over the network (the replicated tensors), and
    # what only the dead node held (its ranks' generators) from the store.
    assert all(e["bytes_from"].get("local", 0) > 0 for e in restored[:2]), restored
    assert all(e["bytes_from"].get("peer", 0) > e["bytes_from"].get("store", 0)
               for e in restored[2:]), restored
    launches = assert_one_launch_per_step(server, node1, world=4)
    expect_steps(server, node1, launches, {0, 100, 200})
    assert launches[200] != launches[100]  # the new launch's


@pytest.fixture(scope="module")
def scaled_in(tmp_path_factory: pytest.TempPathFactory, undisturbed: Outcome) -> Outcome:
    """The undisturbed run of a scale-in: the undisturbed 2 x 2 run up to step
    100 (its store as it was then), and from there the same job on 1 node x 2 ranks."""
    assert undisturbed.store_at_100 is not None
    base = tmp_path_factory.mktemp("scaled-in")
    store = base / "store"
    shutil.copytree(undisturbed.store_at_100, store)
    with Cluster(base, cwd=ROOT) as net:
        (server,) = replicas(net, store=store)
        node1 = net.add_host("node1")
        then = Job("then", net.dir / "then", [server.url], nnodes="1")
        then.start(node1)
        outcome = Outcome.of(then, then.wait(300))
    assert [e["step"] for e in outcome.events if e["event"] == "restored"] == [100, 100]
    return outcome


def test_elastic_scale_in_goes_on_with_the_surviving_node_bitwise(
        cluster: Cluster, undisturbed: Outcome, scaled_in: Outcome) -> None:
    (server,) = replicas(cluster)
    node1, node2 = cluster.add_host("node1"), cluster.add_host("node2")
    # node2's first rank stops inside save(200), before staging anything; the
    # other three ranks store their manifests of step 200.
    # No snapshot the probe asks for: on a loaded host a slow step asks for one, and
    # a step the 4-rank world commits after 100 is where the 2-rank run goes on from,
    # no longer the undisturbed scale-in's step 100 (so no longer bitwise).
    job = Job("scale-in", cluster.dir / "out", [server.url], nnodes="1:2",
              worker_args=["--pause-host", "node2", "--pause-in", "save", "--pause-at", "200",
                           "--pause-after", "-1"],
              env=no_step_time_snapshots(cluster.dir))
    job.start(node1)
    job.start(node2)
    job.wait_event("paused", 240)

    def three_manifests_of_200() -> bool:
        steps = server.get(f"/v1/jobs/{JOB}/steps", via=node1)["steps"]
        return any(s["step"] == 200 and s["ranks_present"] == 3 for s in steps)

    wait_until("ranks 0, 1 and 3 stored step 200", three_manifests_of_200, 60)
    killed = time.time()
    node2.kill()
    results = job.wait(300)

    assert [r["world"] for r in results] == [2, 2]
    assert_bitwise(results, scaled_in.results)
    restored = restores_after(job.events(), killed)
    assert [(e["rank"], e["step"]) for e in restored] == [(0, 100), (1, 100)], restored
    assert all(e["digest"] == undisturbed.saved(100) for e in restored), restored
    # Step 200 is the 2-rank launch's alone: the dead launch's rank-3 manifest of
    # it, past the new world size, is not part of it.
    launches = assert_one_launch_per_step(server, node1, world=4)
    expect_steps(server, node1, launches, {0, 100, 200})
    assert launches[200] != launches[100]
    step_200 = server.get(f"/v1/jobs/{JOB}/steps/200", via=node1)
    assert step_200["world_size"] == 2, step_200


PG_TIMEOUT = 15.0  # how long a rank waits in a collective on a peer gone silent


def test_a_cut_link_stalls_the_node_the_others_detect_it_and_the_job_ends_bitwise(
        cluster: Cluster, undisturbed: Outcome) -> None:
    (server,) = replicas(cluster)
    node1, node2 = cluster.add_host("node1"), cluster.add_host("node2")
    # (no snapshot for a slow step: on a loaded host one committed step 129, and the
    # ranks rightly restored it, not the 100 this test follows)
    job = Job("cut", cluster.dir / "out", [server.url],
              worker_args=["--pause-host", "node2", "--pause-at", "150",
                           "--pg-timeout", str(PG_TIMEOUT)],
              env=no_step_time_snapshots(cluster.dir))
    job.start(node1)
    job.start(node2)
    job.wait_event("paused", 240)
    node2.cut_link()  # the cable pulled: no reset reaches anyone, node2 lives on
    cut = time.time()
    job.release()  # node2's rank goes on into step 150's all-reduce, and stalls there

    def states() -> dict[int, str]:
        return {r["rank"]: r["state"]
                for r in server.get(f"/v1/jobs/{JOB}/ranks", via=node1)["ranks"]}

    # ckptd sees node2's ranks go silent (heartbeats every 2 s, dead after 3 missed)...
    seen = wait_until("the server marks node2's ranks dead",
                      lambda: states() if states().get(2) == states().get(3) == "dead"
                      else None, 20)
    assert seen[0] in ("alive", "degraded") and seen[1] in ("alive", "degraded"), seen
    # ...and torch: node1's ranks give up on the all-reduce after the group's timeout.
    failed = job.wait_event("failed", PG_TIMEOUT + 30, count=2, host="node1", attempt=0)
    detected = max(e["t"] for e in failed) - cut
    assert detected < PG_TIMEOUT + 10, detected
    # node2's ranks stalled where they were: no step finished, nothing saved.
    stalled = [e for e in job.events() if e["host"] == "node2" and e["t"] > cut]
    assert all(e["event"] in ("released", "failed") for e in stalled), stalled
    assert all(e.get("step") == 150 for e in stalled if e["event"] == "failed"), stalled
    node2.mend_link()
    results = job.wait(300)

    assert_bitwise(results, undisturbed.results)
    assert [r["host"] for r in results] == ["node1", "node1", "node2", "node2"]
    restored = restores_after(job.events(), cut)
    assert [(e["rank"], e["step"]) for e in restored] == [(r, 100) for r in range(4)]
    # Every node still had its shared memory: each rank restored from its own pool.
    assert all(e["bytes_from"].get("local", 0) > 0 for e in restored), restored
    launches = assert_one_launch_per_step(server, node1, world=4)
    expect_steps(server, node1, launches, {0, 100, 200})
    assert launches[200] != launches[100]
