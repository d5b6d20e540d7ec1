"""Rank 0's saves as the other ranks see them, so that a load there reads what
rank 0 saved before it.

Lightning and Fabric hand a save to global rank 0 only, then meet every rank at a
barrier; a load that follows runs on every rank (``fabric.load``, a ``Trainer``'s
``validate``/``test`` with ``ckpt_path`` after ``save_checkpoint``). The plugin's
save returns once staged: the upload, commit, tag and pointer follow in rank 0's
background, so another rank reading the pointer at once may find the older step,
or none. Rank 0 counts the saves it queues (before its save returns, so before
that barrier) and the ones it finished (committed and pointed to, or failed) in
the default process group's store; a load on another rank waits until the second
count reaches what the first was when the load began. No collective: a rank that
never loads holds nobody up, and a load waits only for saves already queued.

The plugin's ``teardown`` on another rank waits the same way. Lightning calls it on
every rank when ``fit`` ends, after the barrier that follows ``fit``'s last save;
what comes next (``validate``/``test`` with ``ckpt_path="last"``) picks its path on
each rank from the pointer files it sees, before any barrier: without that wait,
rank 0's first ``last.ckpt`` may not be there yet on another rank.

Keys carry the launch id the group agreed on (``launch.group_launch``), or, in
torchrun's agent store (which outlives a launch) under a group ckptd did not make,
the single agent's launch id: a restarted launch never waits for a dead one's
count. Without either (several agents, no group, one rank) nothing waits."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ckptd.errors import Timeout

from ...launch import ENV, group_initialized, group_launch, launch_incarnation

log = logging.getLogger(__name__)

_QUEUED, _DONE = "queued", "done"


class RankZeroSaves:
    """The counts of one job's saves on rank 0, in the process group's store."""

    def __init__(self, store: Any, prefix: str, job: str, rank: int) -> None:
        self.store = store
        self.prefix = prefix
        self.job = job
        self.rank = rank  # (this process's global rank)
        self._given_up = -1  # (the queued count a teardown's wait timed out at)

    @classmethod
    def here(cls, job: str) -> RankZeroSaves | None:
        """The counts for ``job`` in this launch's group, or None where there is
        nothing to count through (see the module docstring)."""
        if not group_initialized():
            return None
        import torch.distributed as dist

        try:
            if dist.get_world_size() < 2:
                return None
            launch = group_launch()
            if launch is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # (not CKPTD_INCARNATION: torchrun restarts workers with the same one)
                launch = launch_incarnation(
                    {k: v for k, v in os.environ.items() if k != ENV}, group=False)
            if launch is None:
                return None
            store = dist.distributed_c10d._get_default_store()
        except Exception as exc:  # a torch without it: no waiting, as before
            log.debug("rank 0's saves are not counted: %s", exc)
            return None
        return cls(store, f"ckptd/lightning/{launch}/{job}/", job, dist.get_rank())

    def queued(self) -> None:
        """Rank 0 queued a save (or a removal): before the call that queued it returns."""
        self._add(_QUEUED, 1)

    def done(self) -> None:
        """Rank 0 finished one it queued (its pointer written, or it failed)."""
        self._add(_DONE, 1)

    def wait(self, path: str, timeout: float | None) -> None:
        """Waits until rank 0 finished the saves it had queued when this began,
        ``Timeout`` after ``timeout`` seconds (None: no bound)."""
        if not self._wait(timeout)[0]:
            raise Timeout(
                f"{path}: global rank 0's saves before this load did not finish within "
                f"{timeout} s; loading now would read an older checkpoint, or none "
                "(pass a larger timeout= to CkptdCheckpointIO)", job=self.job, path=path)

    def wait_at_teardown(self, timeout: float | None) -> None:
        """``wait`` for a rank's teardown. Once per count: after a ``Timeout`` here
        Lightning calls teardown again (its error path), which does not wait again."""
        finished, want = self._wait(timeout, after=self._given_up)
        if not finished:
            self._given_up = want
            raise Timeout(
                f"job {self.job}: rank {self.rank}'s teardown waited {timeout} s for global "
                "rank 0's saves, which did not finish; a load or a validate/test with "
                "ckpt_path= that follows may read an older checkpoint, or none: pass a "
                "larger timeout= to CkptdCheckpointIO (rank 0's log says why its saves are "
                "slow)", job=self.job)

    def _wait(self, timeout: float | None, after: int = -1) -> tuple[bool, int]:
        """Waits until the count of finished saves reaches the count of queued ones
        as it is now (unless that is at most ``after``): (whether it did within
        ``timeout``, the queued count); True when the store cannot be reached."""
        want = self._add(_QUEUED, 0)
        if want is None or want <= after:
            return True, -1 if want is None else want
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while True:
            done = self._add(_DONE, 0)
            if done is None or done >= want:
                return True, want
            if deadline is not None and time.monotonic() >= deadline:
                return False, want
            left = pause if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(pause, left)))
            pause = min(2 * pause, 0.2)

    def _add(self, key: str, n: int) -> int | None:
        """The count ``key`` after adding ``n``; None when the store cannot be
        reached (its host is gone: nothing to wait for then)."""
        try:
            return int(self.store.add(f"{self.prefix}{key}", n))
        except Exception as exc:
            log.info("cannot count rank 0's saves in the process group's store: %s", exc)
            return None
