"""Process-group set-up for workers that torchrun restarts after a failure."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def init_process_group(backend: str = "gloo", timeout: timedelta = timedelta(minutes=5)) -> None:
    """``dist.init_process_group`` from torchrun's environment, with the keys of
    each restart attempt under their own prefix of the rendezvous store.

    After torchrun restarts a group, the new workers can otherwise meet keys the
    previous attempt left in the store (gloo's peer addresses among them) and wait
    for peers that no longer exist; seen here as restarted workers hanging in
    ``ProcessGroupGloo``'s constructor."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore(f"ckptd/attempt-{attempt}", store)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
