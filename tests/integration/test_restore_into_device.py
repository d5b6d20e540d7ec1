"""A restore into device tensors, end to end on the CPU: the CPU is given a lane
(``restore.devices.LANES``) that copies late on a thread of its own, as a GPU's copy
engine does, so the restore takes its device path (straight from the verified
host bytes into the target's tensors, through bounce buffers) with no GPU.

``atomic=False`` hashes each pool chunk from the bounce buffer it is sent from: a
chunk the pool holds wrong reaches the target, fails its hash, and is sent again
from the store. ``atomic=True`` sends nothing into the target before every chunk
verified: either each chunk is hashed where it lies and then sent, once, or
(``CKPTD_H2D_SCRATCH``) sent and hashed into device memory beside the target, then
copied into it device to device, one copy per tensor. (tests/gpu runs the same
with CUDA.)"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.restore import devices
from ckptd.errors import RestoreError
from tests.late_lane import LateLane

CHUNK = 64 << 10


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch, shm: Path) -> Iterator[list[LateLane]]:
    """The CPU as a laned device; the lanes a restore opened."""
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    monkeypatch.setenv("CKPTD_H2D_PIECE", str(CHUNK // 2))  # several pieces per chunk
    opened: list[LateLane] = []

    def make(device: torch.device, ready: Any, piece: int) -> LateLane:
        lane = LateLane(piece=piece)
        opened.append(lane)
        return lane

    monkeypatch.setitem(devices.LANES, "cpu", make)
    yield opened


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(3 * CHUNK // 4 + 101 * i, generator=g) for i in range(6)}


def spoil(writer: Checkpointer, nbytes: int | None = None) -> None:
    """Overwrites the start of the pool's largest segment (its generation stays
    even: the index still claims the chunks there)."""
    seg = max((p for p in writer.staging.directory.iterdir() if p.name.startswith("seg-")),
              key=lambda p: p.stat().st_size)
    with open(seg, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(0)
        f.write(os.urandom(nbytes or size))


def restore_from_a_spoilt_pool(tmp_path: Path, atomic: bool, seed: int
                               ) -> tuple[dict[str, torch.Tensor], RestoreError]:
    """A one-tensor state saved, every staged byte of it spoilt, and restored from
    the pool alone into zeroed tensors: those tensors and the error."""
    expected = {"t": torch.randn(CHUNK // 4 * 3, generator=torch.Generator().manual_seed(seed))}
    url = f"file://{tmp_path / 'store'}"
    target = {"t": torch.zeros_like(expected["t"])}
    with Checkpointer(url, "lanes", chunk_size=CHUNK, serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        spoil(writer)
        with Checkpointer(url, "lanes", serve_peers=False) as reader, \
                pytest.raises(RestoreError) as info:
            reader.restore(target, tiers=("local",), atomic=atomic)
    return target, info.value


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(("atomic", "scratch"), [(False, "auto"), (True, "0"), (True, "1")])
def test_a_healthy_pool_reaches_the_device_tensors(
        tmp_path: Path, lanes: list[LateLane], monkeypatch: pytest.MonkeyPatch,
        atomic: bool, scratch: str) -> None:
    monkeypatch.setenv("CKPTD_H2D_SCRATCH", scratch)
    expected = state(1)
    url = f"file://{tmp_path / 'store'}"
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    ptrs = {k: t.data_ptr() for k, t in target.items()}
    with Checkpointer(url, "lanes", chunk_size=CHUNK, serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        with Checkpointer(url, "lanes", serve_peers=False) as reader:
            result = reader.restore(target, atomic=atomic)
    for k, v in expected.items():
        assert target[k].data_ptr() == ptrs[k]
        assert torch.equal(target[k].view(torch.int32), v.view(torch.int32)), k
    assert result.bytes_from["local"] == result.bytes_fetched == nbytes(expected)
    # (a restarted process's map of the pool is not page-locked: through bounce buffers)
    assert sum(lane.bounced for lane in lanes) > 0
    straight = sum(lane.direct_copies for lane in lanes)
    if scratch == "1":  # into device memory, then into the target: one copy per tensor
        assert sum(lane.bytes_sent for lane in lanes) == 2 * nbytes(expected)
        assert straight == len(expected)
    else:
        assert sum(lane.bytes_sent for lane in lanes) == nbytes(expected)
        assert straight == 0


@pytest.mark.parametrize("scratch", ["0", "1"])
def test_an_atomic_restore_that_fails_leaves_the_device_tensors_alone(
        tmp_path: Path, lanes: list[LateLane], monkeypatch: pytest.MonkeyPatch,
        scratch: str) -> None:
    monkeypatch.setenv("CKPTD_H2D_SCRATCH", scratch)
    target, error = restore_from_a_spoilt_pool(tmp_path, atomic=True, seed=4)
    assert not target["t"].view(torch.int32).any()  # nothing reached the target
    assert error.detail.get("partial") is not True
    assert "partly restored" not in str(error)


@pytest.mark.parametrize(("atomic", "one_pass", "scratch"),
                         [(False, "1", "auto"), (False, "0", "auto"), (True, "1", "0"),
                          (True, "1", "1")])
def test_a_chunk_the_pool_holds_wrong_is_sent_again_from_the_store(
        tmp_path: Path, lanes: list[LateLane], monkeypatch: pytest.MonkeyPatch,
        atomic: bool, one_pass: str, scratch: str) -> None:
    monkeypatch.setenv("CKPTD_H2D_ONE_PASS", one_pass)
    monkeypatch.setenv("CKPTD_H2D_SCRATCH", scratch)
    expected = state(2)
    url = f"file://{tmp_path / 'store'}"
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    with Checkpointer(url, "lanes", chunk_size=CHUNK, serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        spoil(writer, 1024)
        with Checkpointer(url, "lanes", serve_peers=False) as reader:
            result = reader.restore(target, atomic=atomic)
    for k, v in expected.items():
        assert torch.equal(target[k].view(torch.int32), v.view(torch.int32)), k
    assert result.bytes_from["local"] > 0 and result.bytes_from["store"] > 0
    assert result.bytes_from["local"] + result.bytes_from["store"] == result.bytes_fetched
    assert [p.tier for p in result.problems] == ["local"]
    sent = sum(lane.bytes_sent for lane in lanes)
    if scratch == "1":  # all into device memory; the good ones on, the spoilt one again
        assert sent == nbytes(expected) + (nbytes(expected) - CHUNK) + CHUNK
    elif atomic or one_pass == "0":  # verified where it lies first: sent once, right
        assert sent == nbytes(expected)
    else:  # the spoilt chunk was sent as it was hashed, then again from the store
        assert sent == nbytes(expected) + CHUNK


def test_a_one_pass_restore_that_fails_says_the_device_was_written(
        tmp_path: Path, lanes: list[LateLane]) -> None:
    target, error = restore_from_a_spoilt_pool(tmp_path, atomic=False, seed=3)
    assert target["t"].view(torch.int32).any()  # what the pool gave did land
    assert error.detail["partial"] is True and "partly restored" in str(error)


@pytest.mark.parametrize("atomic", [True, False])
def test_a_device_copy_that_fails_mid_restore_says_the_target_was_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shm: Path, atomic: bool) -> None:
    """A device's own error in the middle of the copies (a CUDA RuntimeError: not one
    of ckptd's) reaches the caller typed, its cause kept, and saying the target is
    partly restored: some tensors got the step's bytes, others did not."""
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    monkeypatch.setenv("CKPTD_H2D_PIECE", str(CHUNK // 2))
    monkeypatch.setitem(devices.LANES, "cpu",
                        lambda device, ready, piece: LateLane(piece=piece, fail_after=2))
    expected = state(5)
    url = f"file://{tmp_path / 'store'}"
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    with Checkpointer(url, "lanes", chunk_size=CHUNK, serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        with Checkpointer(url, "lanes", serve_peers=False) as reader, \
                pytest.raises(RestoreError) as info:
            reader.restore(target, atomic=atomic)
    error = info.value
    assert isinstance(error.__cause__, RuntimeError), repr(error.__cause__)
    assert "illegal memory access" in str(error) and error.detail["step"] == 1
    assert error.detail["partial"] is True and "partly restored" in str(error)
    assert any(target[k].view(torch.int32).any() for k in target)  # some bytes did land


class FailingCopies(torch.Tensor):
    """A tensor whose in-place copies fail as a device's do (a CUDA error raised by
    ``copy_``): a stand-in for a GPU, which this machine lacks."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.Tensor.copy_:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_copy_into_the_target_that_fails_after_the_fetch_says_the_target_was_written(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target tensor the restore cannot fill where it lies (here: not contiguous) is
    assembled beside it and copied in at the end; a device's error in that copy is
    the restore's typed failure too, its cause kept, the target said partly written."""
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    expected = state(7)
    url = f"file://{tmp_path / 'store'}"
    target: dict[str, torch.Tensor] = {k: torch.zeros_like(v) for k, v in expected.items()}
    last = sorted(target)[-1]
    expected[last] = torch.randn(8, 6)
    target[last] = torch.zeros(6, 8).t().as_subclass(FailingCopies)  # (transposed)
    with Checkpointer(url, "copies", chunk_size=CHUNK, serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        with Checkpointer(url, "copies", serve_peers=False) as reader, \
                pytest.raises(RestoreError) as info:
            reader.restore(target)
    error = info.value
    assert isinstance(error.__cause__, RuntimeError), repr(error.__cause__)
    assert "illegal memory access" in str(error) and error.detail["step"] == 1
    assert error.detail["partial"] is True and "partly restored" in str(error)
