"""Fixtures and helpers the Lightning plugin's integration tests share. A module
imports a fixture's function (``*_fixture``) for pytest to find the fixture there,
under the name its tests ask for."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptd.client.integrations.lightning.rank_zero import RankZeroSaves


@pytest.fixture(name="rank_one")
def rank_one_fixture() -> Iterator[RankZeroSaves]:
    """This process as global rank 1 of 2, its group's store a real ``TCPStore`` on
    127.0.0.1; yields rank 0's counts of job ``lit``'s saves in that store, for the
    test to queue and finish saves as rank 0's plugin does. The group is torch's
    ``fake`` backend (no collective reaches anyone): the plugin uses only its rank,
    its store and the launch id agreed there, and a real rank 0 would be a torchrun
    launch (about 10 s of CPU)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=10))
    dist.init_process_group("fake", store=store, rank=1, world_size=2)
    try:
        counts = RankZeroSaves.here("lit")
        assert counts is not None and counts.rank == 1
        yield counts
    finally:
        dist.destroy_process_group()
