"""``dcp.load`` through ckptd's ``Reader`` with DCP's own planner unpickles nothing
without ``weights_only``: DCP's ``load_bytes`` ``torch.load``s a value's bytes with
``weights_only=False``, so ckptd places the value itself (read from the store with
``weights_only=True``, or a JSON value). A planner with a ``load_bytes`` of its own
still gets bytes, ckptd's own."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ckptd.client.dcp import Reader, Writer

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # no process group


def _state() -> dict[str, Any]:
    return {"w": torch.arange(4.0), "epoch": 3, "names": ["a", "b"],
            "pair": (1, 2.5), "blob": io.BytesIO(b"\x00raw\xff")}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(4), "epoch": 0, "names": [], "pair": (0, 0.0),
            "blob": io.BytesIO()}


class OwnBytes(DefaultLoadPlanner):
    """A planner with a ``load_bytes`` of its own: it gets bytes."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.seen = [*getattr(self, "seen", []), read_item.dest_index.fqn]
        super().load_bytes(read_item, value)


def test_dcp_own_planner_gets_values_and_nothing_is_unpickled_without_weights_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"file://{tmp_path / 'store'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=Writer(url, job="v", step=1))
    unsafe: list[object] = []
    real = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("weights_only") is not True:
            unsafe.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    target = _target()
    dcp.load(target, storage_reader=Reader(url, job="v"))
    assert unsafe == []
    assert torch.equal(target["w"], torch.arange(4.0))
    assert (target["epoch"], target["names"], target["pair"]) == (3, ["a", "b"], (1, 2.5))
    assert target["blob"].getvalue() == b"\x00raw\xff"

    # A planner of its own: bytes (ckptd's own torch.save of the value), the same state.
    planner = OwnBytes()
    target = _target()
    dcp.load(target, storage_reader=Reader(url, job="v"), planner=planner)
    assert sorted(planner.seen) == ["blob", "epoch", "names", "pair"]
    assert (target["epoch"], target["names"], target["pair"]) == (3, ["a", "b"], (1, 2.5))
    assert target["blob"].getvalue() == b"\x00raw\xff"
