"""Process-group set-up for workers that torchrun starts and restarts, on one node
or many, and the launch id the group's ranks agree on (``client/launch.py``).

torch 2.13's agent shares its rendezvous TCP store with the workers by default
(``TORCHELASTIC_USE_AGENT_STORE=True``): the store outlives the workers, so keys a
dead launch wrote (gloo's peer addresses among them) are still there when the
next launch's workers meet, and plain ``dist.init_process_group`` then connects to
dead addresses (measured here: 2 restarts of 3 failed, ``Gloo connectFullMesh
failed ... Connection refused``; pytorch/pytorch#135712 for NCCL). Each launch
must meet under a key prefix of its own, and no environment variable names the
launch alike on every node: ``TORCHELASTIC_RESTART_COUNT`` is each agent's own
count (after one node's workers fail, that agent counts a restart and the others
restart uncounted), so a prefix of it hangs across nodes. Here rank 0 draws the
launch's id and publishes it in the store, beating it while it waits; the others
take only an id whose beat they see move (a dead launch's id stands still), and
say so under that id, which no earlier launch used.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (which torch itself needs for a
replacement node to join a job, see ``docs/design/023-launches.md``) worker rank 0
hosts a new store per launch, and this is plain ``dist.init_process_group``."""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptd.errors import Timeout

_KEY = "ckptd/launch"
_BEAT = 0.05  # seconds between rank 0's beats, and the others' looks

# The launch id the group of this process agreed on (``launch.group_launch``).
_agreed: str | None = None


def init_process_group(backend: str = "gloo", timeout: timedelta = timedelta(minutes=5),
                       **kwargs: Any) -> None:
    """``dist.init_process_group`` from torchrun's (or any env:// launcher's)
    environment, correct after restarts on one node or several: with the agent's
    shared store, the launch's ranks agree on a launch id first and meet under it.
    ``kwargs`` go to ``dist.init_process_group`` (``device_id``, ...)."""
    global _agreed
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=False, timeout=timeout)
    launch = agree_on_launch(store, rank, world, timeout.total_seconds())
    prefixed = dist.PrefixStore(f"{_KEY}/{launch}", store)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world,
                            timeout=timeout, **kwargs)
    _agreed = launch


def agree_on_launch(store: Any, rank: int, world: int, timeout: float) -> str:
    """The id every rank of this launch gets from ``store`` (one that outlives
    launches): rank 0 draws it and beats it until every other rank said it has it;
    the others take the first id whose beat moves, and say so under it."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        launch = uuid.uuid4().hex
        acks = [f"{_KEY}/{launch}/has/{r}" for r in range(1, world)]
        beat = 0
        while True:
            store.set(_KEY, f"{launch} {beat}")
            if not acks or store.check(acks):
                return launch
            if time.monotonic() > deadline:
                raise Timeout(f"launch {launch}: ranks of {world} did not join within "
                              f"{timeout:g} s (rank 0 waited for them)", after_s=timeout)
            beat += 1
            time.sleep(_BEAT)
    seen: str | None = None
    while True:
        if store.check([_KEY]):
            now = bytes(store.get(_KEY)).decode()
            if seen is not None and now != seen:  # it moves: rank 0 of this launch
                launch = now.split(" ", 1)[0]
                store.set(f"{_KEY}/{launch}/has/{rank}", "1")
                return launch
            seen = now
        if time.monotonic() > deadline:
            raise Timeout(f"rank {rank}: rank 0 of this launch published no launch id "
                          f"within {timeout:g} s", after_s=timeout)
        time.sleep(_BEAT)


def agreed_launch() -> str | None:
    """The launch id this process's group agreed on through ``init_process_group``
    (None when the group was made otherwise, or not yet)."""
    return _agreed
