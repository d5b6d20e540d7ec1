"""Stateful objects in save and restore: a module, an optimizer, a scheduler and
``RNGState`` go in as themselves; restore fills their state_dict() bitwise, calls
load_state_dict(), puts plain values back and returns the step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.client import Checkpointer, RNGState

pytestmark = pytest.mark.timeout(120)


def trio(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_stateful_objects_and_rng_restore_bitwise(tmp_path: Path, shm: Path) -> None:
    model, opt, sched = trio(0)
    train(model, opt, sched, 3)
    random.seed(5)
    np.random.seed(6)
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(),
             "meta": {"epoch": 7, "tag": "a"}}
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "s", shm_dir=shm) as ckpt:
        ckpt.save(3, state).wait(60)
    expected_draws = draws()
    train(model, opt, sched, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = trio(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    target = {"model": model2, "optim": opt2, "sched": sched2, "rng": RNGState(),
              "meta": {"epoch": 0, "tag": ""}}
    with Checkpointer(url, "s", shm_dir=shm) as ckpt:
        assert ckpt.restore(target).step == 3
    assert target["meta"] == {"epoch": 7, "tag": "a"}
    assert target["model"] is model2 and target["rng"] is not None
    assert draws() == expected_draws  # python, numpy and torch generators restored
    train(model2, opt2, sched2, 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_rng_state_is_saved_rank_local(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    handles = []
    ckpts = [Checkpointer(url, "r", rank=r, world_size=2, shm_dir=shm) for r in range(2)]
    for r, ckpt in enumerate(ckpts):
        torch.manual_seed(100 + r)  # ranks' generators differ: no replica mismatch
        handles.append(ckpt.save(0, {"w": torch.ones(2), "rng": RNGState()}))
    states = [h.wait(60).state for h in handles]
    assert "committed" in states
    for ckpt in ckpts:
        assert ckpt.close().failed == 0


def test_a_module_where_the_checkpoint_holds_no_state_dict_is_refused_in_a_line(
    tmp_path: Path, shm: Path
) -> None:
    """(found by a probe: a module where the step held a tensor or a value raised
    torch's TypeError from load_state_dict; a module in a list was left untouched,
    the list's item replaced by a dict)"""
    from ckptd.errors import InvalidRequest

    url = f"file://{tmp_path / 'store'}"
    saved = torch.nn.Linear(3, 2)
    with Checkpointer(url, "m", shm_dir=shm) as ckpt:
        ckpt.save(1, {"model": saved.state_dict(), "w": saved.weight.detach().clone(),
                      "n": 1, "models": [saved.state_dict()]}).wait(60)
        for target, where in [({"w": torch.nn.Linear(3, 2)}, "state['w']"),
                              ({"n": torch.nn.Linear(3, 2)}, "state['n']"),
                              ({"models": [torch.nn.Linear(3, 2)]}, "state['models'][0]")]:
            before = [t.clone() for t in target_tensors(target)]
            for strict in (True, False):
                with pytest.raises(InvalidRequest, match="state_dict()") as caught:
                    ckpt.restore(target, strict=strict)
                said = str(caught.value)
                assert where in said and "Linear" in said and "\n" not in said, said
            assert all(torch.equal(a, b) for a, b in zip(before, target_tensors(target),
                                                          strict=True))
        model = torch.nn.Linear(3, 2)  # where the step holds its state dict: restored
        assert ckpt.restore({"model": model}, strict=False).step == 1
        assert torch.equal(model.weight, saved.weight)


def target_tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.nn.Module):
        return list(state.state_dict().values())
    if isinstance(state, dict):
        return [t for v in state.values() for t in target_tensors(v)]
    if isinstance(state, list):
        return [t for v in state for t in target_tensors(v)]
    return [state] if isinstance(state, torch.Tensor) else []
