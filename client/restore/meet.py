"""The ranks of one launch meet around a restore, so that a rank on a new node
finds the surviving ranks' pools served before it plans.

After a node is lost, every rank restarts at once: the survivors find their staging
pools in ``/dev/shm`` and serve them to peers once their own restore verified them;
a replacement node's ranks have no pool and plan at once, so their plan named no
peers and every byte came from the store. Here, through the process group's store
(no collective: a rank that never restores holds nobody up for longer than the
wait), a rank with no pool says so and waits, up to ``CKPTD_POOL_WAIT`` seconds,
until every other rank said it serves its pool or has none; a rank with a pool says
so once its restore has served it (and a heartbeat told the server).

Keys carry the launch id the group agreed on, so a restarted launch never reads
the keys of the one before; without an agreed id (a group not made by
``ckptd.client.distributed.init_process_group`` whose store outlives launches)
nothing waits."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from ckptd import knobs

log = logging.getLogger(__name__)


class PoolMeet:
    """One restore's meeting of the ranks of a launch (``here`` makes one)."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.said = False

    @classmethod
    def here(cls, job: str, rank: int, world_size: int) -> PoolMeet | None:
        """A meeting through the default process group's store, or None where
        there is nothing to meet (one rank, no group, another world, no launch id)."""
        if world_size < 2 or knobs.pool_wait() <= 0:
            return None
        from ..launch import group_initialized, group_launch

        if not group_initialized():
            return None
        import torch.distributed as dist

        try:
            if dist.get_world_size() != world_size:
                return None
            launch = group_launch()
            if launch is None:
                return None
            store = dist.distributed_c10d._get_default_store()
        except Exception as exc:  # a torch without it: restore as before
            log.debug("no pool meeting: %s", exc)
            return None
        return cls(store, f"ckptd/pools/{launch}/{job}/", rank, world_size)

    def say(self) -> None:
        """This rank serves its pool now, or has none to serve (once)."""
        if self.said:
            return
        self.said = True
        try:
            self.store.set(f"{self.prefix}{self.rank}", "1")
        except Exception as exc:  # the store's host is gone: the others stop waiting
            log.info("cannot tell the other ranks this pool is served: %s", exc)

    def wait_for_others(self) -> bool:
        """Waits until every other rank said so, at most ``CKPTD_POOL_WAIT`` s;
        False when some did not (the restore then plans with what is served)."""
        wait = knobs.pool_wait()
        keys = [f"{self.prefix}{r}" for r in range(self.world_size) if r != self.rank]
        try:
            self.store.wait(keys, timedelta(seconds=wait))
            return True
        except Exception as exc:  # (torch raises DistStoreError on its timeout)
            log.info("restore: not every rank served its pool within %g s (%s); planning "
                     "with the peers there are", wait, str(exc).splitlines()[0][:200])
            return False
