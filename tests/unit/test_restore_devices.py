"""Chunks bound for device tensors go straight from the verified host bytes into
the target tensor (``WantedChunks.add_device``, and ``devices.to_devices`` called
from ``fetch.deliver``), never before every chunk verified. No GPU here: the
layout's device test is pointed at a CPU tensor, so the same path runs with CPU
copies (tests/gpu runs it on CUDA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.restore import fetch, layout
from ckptd.errors import CkptdError


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.randn(17, generator=g).to(torch.bfloat16),
        "m": torch.rand(33, 5, generator=g) > 0.5,
    }


@pytest.fixture
def as_device(monkeypatch: pytest.MonkeyPatch, shm: Path) -> set[int]:
    """Tensors whose ids are in the returned set take the device path (and the
    staging pool lives in this test's own root)."""
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    chosen: set[int] = set()
    real = layout._on_device

    def on_device(existing: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        if id(existing) in chosen:
            return existing.dtype == dtype and tuple(existing.shape) == shape
        return real(existing, dtype, shape)

    monkeypatch.setattr(layout, "_on_device", on_device)
    real_copy = fetch.to_devices

    def to_devices(found: Any, devices: Any, order: Any = None) -> None:
        calls.append(sum(len(d) for d in devices.values()))
        real_copy(found, devices, order)

    monkeypatch.setattr(fetch, "to_devices", to_devices)
    return chosen


calls: list[int] = []


@pytest.mark.parametrize("tiers", [("store",), ("local",)])
def test_device_targets_are_filled_in_place_bitwise(
    tmp_path: Path, as_device: set[int], tiers: tuple[str, ...]
) -> None:
    state = _state()
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "dev", rank=0, world_size=1, chunk_size=4096, serve_peers=False) as c:
        c.save(1, state).wait(timeout=60)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        before = {k: v for k, v in target.items()}
        as_device.update(id(v) for v in target.values())
        calls.clear()
        result = c.restore(target, tiers=tiers)
    assert calls and sum(calls) == result.chunks  # every chunk went the device way
    assert result.bytes_from.get(tiers[0]) == result.bytes_fetched
    for k, v in state.items():
        assert target[k] is before[k]  # filled where it lies, not replaced
        assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8))


def test_device_targets_stay_untouched_when_a_chunk_has_no_source(
    tmp_path: Path, as_device: set[int]
) -> None:
    state = _state()
    store = tmp_path / "store"
    with Checkpointer(f"file://{store}", "dev", rank=0, world_size=1, chunk_size=4096,
                      serve_peers=False) as c:
        c.save(1, state).wait(timeout=60)
    victim = sorted((store / "chunks").rglob("*"))[-1]
    assert victim.is_file()
    victim.write_bytes(b"x" * victim.stat().st_size)
    with Checkpointer(f"file://{store}", "dev", rank=0, world_size=1, serve_peers=False) as c:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        as_device.update(id(v) for v in target.values())
        with pytest.raises(CkptdError):
            c.restore(target, tiers=("store",))
    for v in target.values():
        assert not v.view(torch.uint8).any()  # atomic: nothing written


def test_a_restore_inside_inference_mode_fills_inference_tensors(
    tmp_path: Path, as_device: set[int]
) -> None:
    """The device copies run on a worker thread; inference mode is per thread, so
    they re-enter the caller's (an in-place copy into an inference tensor outside
    it is refused)."""
    state = _state()
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "dev", rank=0, world_size=1, chunk_size=4096, serve_peers=False) as c:
        c.save(1, state).wait(timeout=60)
        with torch.inference_mode():
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            as_device.update(id(v) for v in target.values())
            calls.clear()
            c.restore(target, tiers=("store",))
    assert calls
    for k, v in state.items():
        assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8))
