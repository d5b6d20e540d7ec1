"""A whole node lost from a 2 x 2-rank torchrun job (c10d rendezvous, the
README's loop, one ``ckptd serve`` on a host of its own), each run against an
undisturbed run of the same steps, bitwise:

- the node SIGKILLed with its shared memory, a replacement node joins;
- elastic scale-in (``--nnodes=1:2``): the node dies mid-save, nobody replaces it;
- the node's link cut, the node alive: its ranks stall, the others detect it,
  the job goes on once the link is back."""

from __future__ import annotations

import time

import pytest

from tests.multinode.hosts import Cluster
from tests.multinode.jobs import Job, replicas
from tests.multinode.outcomes import (
    Outcome,
    assert_bitwise,
    assert_one_launch_per_step,
    restores_after,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]


def test_a_killed_node_is_replaced_and_the_job_ends_bitwise(
        cluster: Cluster, undisturbed: Outcome) -> None:
    (server,) = replicas(cluster)
    node1, node2 = cluster.add_host("node1"), cluster.add_host("node2")
    # node2's first rank stops before step 150 once step 100 is committed: the
    # others wait for it in their next all-reduce, as they would for a dying node.
    job = Job("replace", cluster.dir / "out", [server.url],
              worker_args=["--pause-host", "node2", "--pause-at", "150"])
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
    assert set(launches) == {0, 100, 200}
    assert launches[200] != launches[100]  # the new launch's
