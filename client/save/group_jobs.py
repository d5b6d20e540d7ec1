"""Every rank of a launch saving under one job name, checked through the process
group's store (no collective). A replacement node started with another ``JOB`` (a
typo, a "-v2") restored nothing, trained from step 0 all-reduced with ranks at step
20, and saved steps that never commit in either job, without a word (found by a
multinode probe). Its first save notes the job under the launch; its second says,
once, when the launch's ranks save under several jobs and too few under this one.

Only a warning: one process may run several checkpointers of several jobs (a model
and its EMA), each on every rank, and those agree."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "ckptd/jobs"


class GroupJobs:
    """One checkpointer's job, noted in its launch's group store at its first save
    and compared with the others' at its second."""

    def __init__(self, job: str, rank: int, world_size: int) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self._saves = 0

    def saving(self, launch: str | None) -> None:
        """Called at each save, with the launch the save names."""
        self._saves += 1
        if self._saves > 2 or launch is None or self.world_size < 2:
            return
        store = _group_store()
        if store is None:
            return
        key = f"{PREFIX}/{launch}"
        try:
            if self._saves == 1:
                if int(store.add(f"{key}/{self.job}", 1)) == 1:
                    store.append(key, f"{self.job}\n")
                return
            jobs = bytes(store.get(key)).decode().split()
            counts = {j: int(store.add(f"{key}/{j}", 0)) for j in dict.fromkeys(jobs)}
        except Exception as exc:  # (the store's host gone: nothing to compare with)
            log.debug("%s/%d: cannot compare jobs through the group's store: %s",
                      self.job, self.rank, exc)
            return
        if len(counts) > 1 and counts.get(self.job, 0) < self.world_size:
            listed = ", ".join(f"{j} ({n})" for j, n in counts.items())
            log.warning(
                "%s/%d: the ranks of this launch save under several jobs, with so many "
                "ranks each: %s, of a world of %d. A job's steps commit only with every "
                "rank's manifest: none of these will. Every rank of a run names one job "
                "(each node's JOB, or job=); a replacement node started with another "
                "name restored nothing and trains out of step", self.job, self.rank,
                listed, self.world_size)


def _group_store() -> Any | None:
    """The default process group's store, or None without a group."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception as exc:  # (a torch without it)
        log.debug("no store of the default process group: %s", exc)
        return None
