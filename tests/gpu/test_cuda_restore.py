"""Restore into CUDA tensors, every tier (issue 11): this rank's staging pool, the
store read in place (``file://``), the server's store over HTTP, and live peers.
The target holds CUDA tensors of the right shapes (a constructed model on the
GPU); each restore must leave them bitwise the saved state, still on the device.
Skipped without a CUDA device."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import RestoreError
from tests.conftest import ServerProcess
from tests.integration.peer_fixtures import peer_server  # noqa: F401 (fixtures)
from tests.integration.restore_peer import (
    CHUNK,
    TOKEN,
    make_state,
    spawn,
    wait_held,
    wait_ready,
)

DEVICE = "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]

NBYTES = 8 << 20
SMALL = 64 << 10  # chunks of the spoilt-pool tests


def on_device(state: Any) -> Any:
    """The state with every tensor zeroed on the device: a target to restore into."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state, device=DEVICE)
    if isinstance(state, dict):
        return {k: on_device(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_device(v) for v in state]
    return state


def assert_bitwise_on_device(target: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(target, torch.Tensor) and target.device.type == DEVICE
        got, want = target.cpu(), expected.cpu()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(expected, dict):
        assert target.keys() == expected.keys()
        for k in expected:
            assert_bitwise_on_device(target[k], expected[k])
    elif isinstance(expected, list):
        assert len(target) == len(expected)
        for a, b in zip(target, expected, strict=True):
            assert_bitwise_on_device(a, b)
    else:
        assert target == expected


@pytest.mark.parametrize(("tier", "blocking"), [("local", "0"), ("store", "0"),
                                               ("store-file", "0"), ("local", "1")])
def test_restore_into_cuda_tensors_from_each_tier(srv: ServerProcess, shm: Path,
                                                 tier: str, blocking: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_H2D_BLOCKING_EVENTS", blocking)  # (bounce buffers' events)
    expected = make_state(11, NBYTES)
    url = f"file://{srv.store}" if tier == "store-file" else srv.url
    target = on_device(expected)
    ptrs = [t.data_ptr() for t in tensors(target)]
    # The saver stays open: its staging pool is the local tier of the restore.
    with Checkpointer(srv.url, "gpu", token=TOKEN, chunk_size=CHUNK, shm_dir=shm) as saver:
        saver.save(3, expected).wait(timeout=60)
        with Checkpointer(url, "gpu", token=TOKEN, chunk_size=CHUNK, shm_dir=shm) as ckpt:
            result = ckpt.restore(target, tiers=(tier.removesuffix("-file"),))
    assert result.step == 3
    assert result.bytes_from.get(tier.removesuffix("-file"), 0) == result.bytes_fetched > 0
    assert_bitwise_on_device(target, expected)
    # Filled where they lie (straight from the verified host bytes), not replaced.
    assert [t.data_ptr() for t in tensors(target)] == ptrs


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors(v)]
    if isinstance(state, list):
        return [t for v in state for t in tensors(v)]
    return []


def test_restore_into_cuda_tensors_from_peers(srv: ServerProcess, shm: Path) -> None:
    expected = make_state(12, NBYTES)
    procs = [spawn(srv.url, "gpu-peers", r, 3, 7, seed=12, nbytes=NBYTES) for r in (0, 1)]
    try:
        with Checkpointer(srv.url, "gpu-peers", rank=2, world_size=3, token=TOKEN,
                          chunk_size=CHUNK, shm_dir=shm) as ckpt:
            ckpt.save(7, expected).wait(timeout=60)
        for p in procs:
            wait_ready(p)
        wait_held(srv, "gpu-peers", [0, 1], 7)
        target = on_device(expected)
        with Checkpointer(srv.url, "gpu-peers", rank=2, world_size=3, token=TOKEN,
                          chunk_size=CHUNK, shm_dir=shm / "new-node") as ckpt:
            result = ckpt.restore(target, tiers=("peer",))
        assert result.bytes_from.get("peer", 0) == result.bytes_fetched > 0
        assert_bitwise_on_device(target, expected)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_restore_follows_the_callers_stream(srv: ServerProcess, shm: Path) -> None:
    """The copies run on a worker thread's side stream; they must still come after
    work the caller queued on its own current stream (here a long sleep, then a
    fill of the target that a racing copy would land under)."""
    expected = make_state(13, NBYTES)
    target = on_device(expected)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with Checkpointer(f"file://{srv.store}", "gpu-order", chunk_size=CHUNK,
                      shm_dir=shm) as ckpt:
        ckpt.save(1, expected).wait(timeout=60)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s, then the fill
            for t in tensors(target):
                t.fill_(7) if t.dtype != torch.bool else t.fill_(True)
            ckpt.restore(target, tiers=("local",))
    torch.cuda.synchronize()
    assert_bitwise_on_device(target, expected)


def _spoil_largest_segment(directory: Path, nbytes: int | None = None) -> None:
    """Overwrites the start of the pool's largest segment (its generation stays
    even: the index still claims the chunks there)."""
    seg = max((p for p in directory.iterdir() if p.name.startswith("seg-")),
              key=lambda p: p.stat().st_size)
    with open(seg, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(0)
        f.write(os.urandom(nbytes or size))


@pytest.mark.parametrize(("atomic", "scratch"), [(False, "auto"), (True, "0"), (True, "1")])
def test_a_chunk_the_pool_holds_wrong_reaches_the_device_from_the_store(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool,
        scratch: str) -> None:
    """``atomic=False`` sends the pool's chunks to the device as it hashes them (from
    the bounce buffers): one that does not verify is sent again from the store, so
    the device tensors end bitwise the checkpoint all the same. Atomic, the same
    into device memory beside the target (``CKPTD_H2D_SCRATCH=1``), or hashed first."""
    monkeypatch.setenv("CKPTD_H2D_SCRATCH", scratch)
    g = torch.Generator().manual_seed(9)
    expected = {f"t{i}": torch.randn(3 * SMALL // 4 + 101 * i, generator=g) for i in range(6)}
    url = f"file://{tmp_path / 'store'}"
    target = on_device(expected)
    ptrs = [t.data_ptr() for t in tensors(target)]
    with Checkpointer(url, "gpu-spoilt", chunk_size=SMALL, shm_dir=shm,
                      serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        _spoil_largest_segment(writer.staging.directory, 1024)
        with Checkpointer(url, "gpu-spoilt", shm_dir=shm, serve_peers=False) as reader:
            result = reader.restore(target, atomic=atomic)
    assert_bitwise_on_device(target, expected)
    assert [t.data_ptr() for t in tensors(target)] == ptrs
    assert result.bytes_from["local"] > 0 and result.bytes_from["store"] > 0
    assert result.bytes_from["local"] + result.bytes_from["store"] == result.bytes_fetched
    assert [p.tier for p in result.problems] == ["local"]


def _restore_from_a_spoilt_pool(tmp_path: Path, shm: Path, atomic: bool, seed: int
                                ) -> tuple[dict[str, torch.Tensor], RestoreError]:
    """A one-tensor state saved, every staged byte of it spoilt, and restored from
    the pool alone into zeroed CUDA tensors: those tensors and the error."""
    expected = {"t": torch.randn(SMALL // 4 * 3, generator=torch.Generator().manual_seed(seed))}
    url = f"file://{tmp_path / 'store'}"
    target = on_device(expected)
    with Checkpointer(url, "gpu-spoilt-all", chunk_size=SMALL, shm_dir=shm,
                      serve_peers=False) as writer:
        writer.save(1, expected).wait(timeout=60)
        _spoil_largest_segment(writer.staging.directory)
        with Checkpointer(url, "gpu-spoilt-all", shm_dir=shm, serve_peers=False) as reader, \
                pytest.raises(RestoreError) as info:
            reader.restore(target, tiers=("local",), atomic=atomic)
    return target, info.value


def test_a_one_pass_restore_into_cuda_that_fails_says_the_device_was_written(
        tmp_path: Path, shm: Path) -> None:
    target, error = _restore_from_a_spoilt_pool(tmp_path, shm, atomic=False, seed=2)
    assert target["t"].view(torch.int32).any()  # what the pool gave did land
    assert error.detail["partial"] is True and "partly restored" in str(error)


def test_an_atomic_restore_into_cuda_that_fails_leaves_the_target_alone(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent and hashed into device memory beside the target, the spoilt chunks never
    reach the target itself."""
    monkeypatch.setenv("CKPTD_H2D_SCRATCH", "1")
    target, error = _restore_from_a_spoilt_pool(tmp_path, shm, atomic=True, seed=3)
    assert not target["t"].view(torch.int32).any()
    assert error.detail.get("partial") is not True
