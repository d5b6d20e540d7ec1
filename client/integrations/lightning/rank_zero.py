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

    def __init__(self, store: Any, prefix: str, job: str) -> None:
        self.store = store
        self.prefix = prefix
        self.job = job

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
        return cls(store, f"ckptd/lightning/{launch}/{job}/", job)

    def queued(self) -> None:
        """Rank 0 queued a save (or a removal): before the call that queued it returns."""
        self._add(_QUEUED, 1)

    def done(self) -> None:
        """Rank 0 finished one it queued (its pointer written, or it failed)."""
        self._add(_DONE, 1)

    def wait(self, path: str, timeout: float | None) -> None:
        """Waits until rank 0 finished the saves it had queued when this began,
        ``Timeout`` after ``timeout`` seconds (None: no bound)."""
        want = self._add(_QUEUED, 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while want is not None:
            done = self._add(_DONE, 0)
            if done is None or done >= want:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise Timeout(
                    f"{path}: global rank 0's saves before this load did not finish within "
                    f"{timeout} s; loading now would read an older checkpoint, or none "
                    "(pass a larger timeout= to CkptdCheckpointIO)", job=self.job, path=path)
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def _add(self, key: str, n: int) -> int | None:
        """The count ``key`` after adding ``n``; None when the store cannot be
        reached (its host is gone: nothing to wait for then)."""
        try:
            return int(self.store.add(f"{self.prefix}{key}", n))
        except Exception as exc:
            log.info("cannot count rank 0's saves in the process group's store: %s", exc)
            return None
