"""``Checkpointer.step``: the loop's health reaches snapshots and rollbacks."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.health.policy_file import parse_policy
from ckptd.client.health.readings import ScriptedSource
from ckptd.errors import RollbackRequested

FAST = parse_policy("[probe]\ninterval_s = 0.05\n\n[actions]\nsnapshot_min_interval_s = 0\n")


def test_a_nan_loss_raises_rollback_once_and_is_never_saved(tmp_path: Path) -> None:
    state = {"w": torch.arange(2048.0)}
    with Checkpointer(f"file://{tmp_path}/s", job="nan", health_policy=FAST,
                      health_sources=[ScriptedSource([{}])]) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        assert ckpt.step(1, loss=0.5, state=state) is None
        with pytest.raises(RollbackRequested) as caught:
            ckpt.step(2, loss=math.nan, state=state)
        assert caught.value.rollback_to == 1 and caught.value.step == 2
        ckpt.restore(state)  # the loop goes back; restore acknowledges the rollback
        assert ckpt.step(2, loss=0.4, state=state) is None  # no second raise
        assert ckpt.latest() == 1


def test_a_degraded_signal_makes_the_loop_save_with_the_reason(tmp_path: Path) -> None:
    hot = {"gpu_ecc_uncorrected_volatile[0]": 50}
    state = {"w": torch.arange(2048.0)}
    with Checkpointer(f"file://{tmp_path}/s", job="ecc", health_policy=FAST,
                      health_sources=[ScriptedSource([hot])]) as ckpt:
        handle = None
        deadline = time.monotonic() + 10
        step = 0
        while handle is None and time.monotonic() < deadline:  # bounded: a few probe ticks
            step += 1
            handle = ckpt.step(step, loss=1.0, state=state)
            time.sleep(0.05)
        assert handle is not None, "no coordinated snapshot within 10 s"
        assert handle.wait(timeout=60).state == "committed"
        record = ckpt._call(ckpt.transport.read_commit("ecc", handle.step), 30)
        assert record.meta["reason"] == "health"


def test_meta_and_tag_given_to_step_go_with_the_snapshot_reason(tmp_path: Path) -> None:
    ecc = "gpu_ecc_uncorrected_volatile[0]"
    source = ScriptedSource([{ecc: 0}])
    state = {"w": torch.arange(2048.0)}
    with Checkpointer(f"file://{tmp_path}/s", job="ecc", health_sources=[source]) as ckpt:
        assert ckpt.step(1, loss=1.0, state=state) is None
        source.push({ecc: 2})
        ckpt._health_agent().probe.evaluate_now()  # degraded: a snapshot at the next step
        # meta= reaches save() with the snapshot's own (a TypeError before: twice meta=).
        handle = ckpt.step(2, loss=0.5, state=state, meta={"loss": 0.5, "reason": "mine"},
                           tag="hot")
        assert handle is not None and handle.wait(timeout=60).state == "committed"
        record = ckpt._call(ckpt.transport.read_commit("ecc", 2), 30)
    assert record.meta == {"loss": 0.5, "reason": "health", "requested_by": 0, "tag": "hot"}
