"""Staging from CUDA: pinned pool segments, copies on a side stream ordered after
the training stream, ``save()`` returning before the copies finish, and the
contract for when the tensors may change again. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import Timeout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

# About 50 ms of GPU time: long enough that the copies queued after it cannot be
# done when save() returns.
SLEEP_CYCLES = 100_000_000




def gpu_state(seed: int, big: int = 1 << 20) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(big, device="cuda", generator=g),
        "bf": torch.randn(257, 33, device="cuda", generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 48, device="cuda", generator=g).t(),  # non-contiguous
        "i": torch.arange(1000, device="cuda"),
        "cpu": torch.ones(10),  # a CPU tensor in a CUDA state
        "step": 3,
    }


def on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            x, y = a[k].cpu(), b[k].cpu()
            assert x.dtype == y.dtype and x.shape == y.shape, k
            x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
            assert torch.equal(x, y), k
        else:
            assert a[k] == b[k], k


def restored(ckpt: Checkpointer, step: int) -> dict[str, Any]:
    target: dict[str, Any] = {}
    ckpt.restore(target, step=step)
    return target


def mutate(state: dict[str, Any]) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)


@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["whole", "budget"])
def test_cuda_state_commits_bitwise_after_staged(tmp_path: Path, shm: Path,
                                                 budget: int | None) -> None:
    state = gpu_state(0)
    expected = on_cpu(state)
    with Checkpointer(f"file://{tmp_path}/s", "gpu", chunk_size=1 << 18, shm_dir=shm,
                      staging_budget=budget) as ckpt:
        handle = ckpt.save(1, state)
        handle.staged()
        mutate(state)
        handle.wait(timeout=60)
        assert (handle.pieces > 1) == (budget is not None)
        assert all(seg.pinned for seg in ckpt.staging._segments)
        assert_same(restored(ckpt, 1), expected)
        # warm: no new segment
        created = ckpt.staging.stats.segments_created
        expected = on_cpu(state)
        h = ckpt.save(2, state)
        h.staged()
        mutate(state)
        h.wait(timeout=60)
        assert ckpt.staging.stats.segments_created == created
        assert_same(restored(ckpt, 2), expected)
    assert not any(shm.rglob("*"))


def test_save_returns_before_the_copy_of_a_large_tensor_is_done(tmp_path: Path,
                                                                shm: Path) -> None:
    state = gpu_state(1, big=64 << 20)  # 256 MiB
    with Checkpointer(f"file://{tmp_path}/s", "async", shm_dir=shm) as ckpt:
        ckpt.save(1, state).wait(timeout=120)  # warm: the pool exists and is pinned
        expected = on_cpu(state)
        torch.cuda._sleep(SLEEP_CYCLES)  # the training stream is busy
        handle = ckpt.save(2, state)
        assert handle._copy_done is not None and not handle._copy_done.query()
        handle.staged()
        assert handle._copy_done.query()
        mutate(state)
        handle.wait(timeout=120)
        assert_same(restored(ckpt, 2), expected)
        # The same with a timeout: a thread sleeps on the events for this one.
        expected = on_cpu(state)
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = ckpt.save(3, state)
        assert handle._copy_done is not None and not handle._copy_done.query()
        handle.staged(timeout=60)
        assert handle._copy_done.query()
        mutate(state)
        handle.wait(timeout=120)
        assert_same(restored(ckpt, 3), expected)
        expected = on_cpu(state)
        torch.cuda._sleep(SLEEP_CYCLES * 100)  # far longer than the timeout below
        handle = ckpt.save(4, state)
        with pytest.raises(Timeout):
            handle.staged(timeout=0.01)
        handle.staged()
        mutate(state)
        handle.wait(timeout=120)
        assert_same(restored(ckpt, 4), expected)


def test_kernels_queued_after_block_current_stream_run_after_the_copies(
    tmp_path: Path, shm: Path
) -> None:
    state = gpu_state(2, big=16 << 20)
    with Checkpointer(f"file://{tmp_path}/s", "block", shm_dir=shm) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        expected = on_cpu(state)
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = ckpt.save(2, state)  # block_training=True is the default
        # No host wait: the optimizer step is queued on the same stream, after the copies.
        mutate(state)
        handle.wait(timeout=60)
        assert_same(restored(ckpt, 2), expected)


def test_a_temporary_freed_after_save_is_not_reused_under_the_copy(
    tmp_path: Path, shm: Path
) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(4 << 20, device="cuda", generator=g)
    with Checkpointer(f"file://{tmp_path}/s", "temp", shm_dir=shm) as ckpt:
        ckpt.save(1, {"half": w.half()}).wait(timeout=60)
        expected = w.half().cpu()
        torch.cuda._sleep(SLEEP_CYCLES)
        handle = ckpt.save(2, {"half": w.half()})  # the temporary is freed on return
        junk = torch.full((4 << 20,), 7.0, device="cuda", dtype=torch.half)  # reuses it?
        handle.wait(timeout=60)
        del junk
        assert torch.equal(restored(ckpt, 2)["half"].view(torch.int16),
                           expected.view(torch.int16))
