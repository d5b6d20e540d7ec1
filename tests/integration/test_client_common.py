"""Training states and bitwise comparisons shared by the client integration tests
(``test_client_file.py``, ``test_client_http.py``); it holds no tests itself."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.client.dtypes import byte_view


@dataclass
class Trainer:
    """A small transformer block (some parameters bf16), AdamW and OneCycleLR."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "sched": self.sched.state_dict(),
        }

    def load(self, state: dict[str, Any]) -> None:
        """What a training script does after ``restore`` filled its state dict."""
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])


def make_trainer(seed: int, steps: int = 0) -> Trainer:
    torch.manual_seed(seed)
    model = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128)
    model.linear1.to(torch.bfloat16)
    model.norm2.to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=1e-2, total_steps=50)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        # Gradients drawn at random: the state is what matters, not the loss, and
        # a mixed-dtype block has no forward pass.
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        optim.step()
        sched.step()
    return Trainer(model, optim, sched)


def training_state(trainer: Trainer) -> dict[str, Any]:
    """The trainer's state plus the scalars a loop keeps next to it."""
    return {
        **trainer.state(),
        "step": 3,
        "loss": 0.125,
        "best": float("inf"),
        "last_bad": float("nan"),
        "tag": "run-α",
        "rng": torch.get_rng_state(),
        "flags": [True, None, (1, 2.5)],
    }


def snapshot(value: Any) -> Any:
    """A deep copy with tensors cloned, to compare with later."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    return value


def assert_bitwise(a: Any, b: Any, path: str = "state") -> None:
    """Equal: tensors in dtype, shape and every byte; containers and scalars by value
    and type (NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert bytes(byte_view(a.detach().contiguous())) == bytes(
            byte_view(b.detach().contiguous())
        ), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}[{k!r}]")
        return
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def fresh_target(seed: int) -> tuple[Trainer, dict[str, Any]]:
    """A fresh trainer (AdamW with empty state) and the state dict to restore into."""
    trainer = make_trainer(seed, steps=0)
    return trainer, trainer.state()


def assert_trainer_equals(restored: Trainer, expected: dict[str, Any]) -> None:
    state = restored.state()
    assert_bitwise(dict(state["model"]), dict(expected["model"]), "model")
    assert_bitwise(state["optim"], expected["optim"], "optim")
    assert_bitwise(state["sched"], expected["sched"], "sched")
    assert len(state["optim"]["state"]) == len(list(restored.model.parameters()))
