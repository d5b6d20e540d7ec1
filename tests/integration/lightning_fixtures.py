"""Fixtures and helpers the Lightning plugin's integration tests share. A test
module imports a fixture's function (``*_fixture``) for pytest to find the fixture
there, under the name its tests ask for. Import this module after
``pytest.importorskip("lightning")``: it imports the plugin."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptd.client.integrations.lightning import CkptdCheckpointIO
from ckptd.client.integrations.lightning.rank_zero import RankZeroSaves


@pytest.fixture(name="store")
def store_fixture(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture(name="io")
def io_fixture(store: str, shm: Path) -> Iterator[CkptdCheckpointIO]:
    plugin = CkptdCheckpointIO(store, job="lit", shm_dir=str(shm))
    try:
        yield plugin
    finally:
        plugin.teardown()


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


def small_checkpoint(step: int, seed: int = 0) -> dict[str, Any]:
    """What Lightning's dump_checkpoint builds, in small."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    key = "ModelCheckpoint{'monitor': 'loss', 'mode': 'min', 'every_n_train_steps': 0}"
    return {
        "epoch": 1, "global_step": step, "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": step},
                               "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {key: {"best_model_score": torch.tensor(0.25),
                            "best_k_models": {"/ckpts/epoch=0-step=4.ckpt": torch.tensor(0.5)},
                            "kth_value": torch.tensor(float("inf")), "last_model_path": "",
                            "dirpath": "/ckpts"}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [{"step_size": 1, "gamma": 0.5, "base_lrs": [0.1], "last_epoch": 1}],
        "MixedPrecision": {"scale": 65536.0, "growth_tracker": 0},
        "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.1, "betas": (0.9, 0.99),
                                                       "name": None, "bf16": torch.ones(2,
                                                       dtype=torch.bfloat16)},
    }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a`` equals ``b``: tensors bitwise and of one dtype, the rest of one type."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b and type(a) is type(b), (where, a, b)
