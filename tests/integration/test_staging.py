"""The staging pool: reuse without allocation, the byte budget, shared-memory
files named by job and rank, what is left after a close, an exit or a crash, and
the index and seqlock a restarted worker reads."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_client_common import assert_bitwise, snapshot

from ckptd.client import Checkpointer, Shard
from ckptd.client.dtypes import byte_view
from ckptd.client.save.placement import placements
from ckptd.client.staging import pool as staging_pool
from ckptd.client.staging.layout import SEGMENT_GRAIN
from ckptd.client.staging.pool import StagingPool
from ckptd.client.staging.reader import remove_stale_pools
from ckptd.client.staging.segments import pool_dir
from ckptd.errors import InvalidRequest
from ckptd.hashing import chunk_id

pytestmark = pytest.mark.timeout(60)

CS = 4100  # a chunk size that splits float64 and float32 elements




@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def mixed_state(seed: int = 0) -> dict[str, Any]:
    """Every kind of tensor staging must copy exactly: dtypes of 1 to 8 bytes,
    non-contiguous views, a 0-dim and an empty tensor, plus plain values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "f64": torch.randn(3000, dtype=torch.float64, generator=g),
        "transposed": torch.randn(60, 100, generator=g).t(),
        "strided": torch.randn(40, 300, generator=g)[:, ::3],
        "bf16": torch.randn(25_000, generator=g).to(torch.bfloat16),
        "i8": torch.arange(-7, 7, dtype=torch.int8),
        "i64": torch.randint(0, 1 << 40, (333,), generator=g),
        "mask": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "step": 4,
    }


def mutate(state: dict[str, Any]) -> None:
    """What a training step does to the tensors, in place."""
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.numel():
            if v.dtype == torch.bool:
                v.logical_not_()
            else:
                v.add_(1)


def nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def restored(ckpt: Checkpointer, step: int) -> dict[str, Any]:
    target: dict[str, Any] = {}
    ckpt.restore(target, step=step)
    return target


class CountingSegments:
    """Counts every segment the pool creates, below its own statistics."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        real = staging_pool._create_segment  # what the pool calls

        def counted(directory: Path, file: str, n: int, stats: Any) -> Any:
            self.calls.append(n)
            return real(directory, file, n, stats)

        monkeypatch.setattr(staging_pool, "_create_segment", counted)


def test_a_warm_save_allocates_nothing_and_copies_into_the_same_views(
    shm: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = CountingSegments(monkeypatch)
    state = mixed_state()
    expected = []
    with Checkpointer(url, "warm", chunk_size=CS, shm_dir=shm) as ckpt:
        pool = ckpt.staging
        assert pool.directory == pool_dir("warm", 0, shm)
        expected.append(snapshot(state))
        ckpt.save(1, state).wait(timeout=30)
        first = {k: v.data_ptr() for k, v in pool._buffers.items()}
        assert len(first) == 8  # every tensor with bytes, whole, in the pool
        stats = (pool.stats.segments_created, pool.stats.bytes_allocated, pool.stats.layouts)
        assert len(created.calls) == 1 and stats == (1, created.calls[0], 1)
        for step in (2, 3):
            mutate(state)
            expected.append(snapshot(state))
            ckpt.save(step, state).wait(timeout=30)
            assert len(created.calls) == 1
            assert (pool.stats.segments_created, pool.stats.bytes_allocated,
                    pool.stats.layouts) == stats
            assert {k: v.data_ptr() for k, v in pool._buffers.items()} == first
        assert pool.stats.stages == 3
        for step, exp in enumerate(expected, start=1):
            assert_bitwise(restored(ckpt, step), exp)
    assert files(shm) == []


@pytest.mark.parametrize("budget", [None, 40_000], ids=["whole", "budget"])
def test_changing_tensors_after_save_returns_does_not_change_the_commit(
    shm: Path, url: str, budget: int | None
) -> None:
    state = mixed_state(seed=1)
    expected = snapshot(state)
    with Checkpointer(url, "mut", chunk_size=CS, staging_budget=budget, shm_dir=shm) as ckpt:
        handle = ckpt.save(1, state)
        handle.staged()  # at once on the CPU: the copy is done when save returns
        mutate(state)
        state["f64"].zero_()
        handle.wait(timeout=30)
        assert (handle.pieces == 1) == (budget is None)
        assert_bitwise(restored(ckpt, 1), expected)


def test_a_state_three_times_the_budget_stays_within_it_and_chunks_alike(
    shm: Path, url: str
) -> None:
    budget = 40_000
    state = mixed_state(seed=2)
    assert nbytes(state) >= 3 * budget * 0.8
    big = {"big": torch.randn(3 * budget // 4 + 17, generator=torch.Generator().manual_seed(3))}
    with Checkpointer(url, "small", chunk_size=CS, staging_budget=budget, shm_dir=shm) as ckpt:
        for step, s in ((1, state), (2, big), (3, {**state, **big})):
            handle = ckpt.save(step, s)
            result = handle.wait(timeout=30)
            assert handle.pieces >= 3
            assert result.bytes_staged == nbytes(s)
            assert_bitwise(restored(ckpt, step), s)
        stats = ckpt.staging.stats
        assert stats.peak_bytes_mapped <= budget
        assert stats.segments_created == 1  # the pieces reuse one budget-sized segment
    # A whole-state save of the same tensors names the same chunks: it sends nothing.
    with Checkpointer(url, "whole", chunk_size=CS, shm_dir=shm) as ckpt:
        again = ckpt.save(1, {**state, **big}).wait(timeout=30)
    assert (again.bytes_sent, again.chunks_sent) == (0, 0)
    assert files(shm) == []


def test_conjugate_and_negated_views_stage_as_their_values_in_pieces_too(
    shm: Path, url: str
) -> None:
    """``x.conj()`` and the negated views torch makes of it hold no bytes of their
    own: staging copies their values, whole or split inside an element."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(6000, dtype=torch.complex64, generator=g)
    state = {
        "conj": base.conj(),  # contiguous, conjugate bit
        "conj_t": torch.randn(50, 90, dtype=torch.complex64, generator=g).conj().t(),
        "neg": base.conj().imag,  # a strided view with the negative bit
    }
    assert state["conj"].is_conj() and state["neg"].is_neg()
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    sent = []
    for budget in (40_000, None):
        with Checkpointer(url, f"views{budget or 0}", chunk_size=CS, staging_budget=budget,
                          shm_dir=shm) as ckpt:
            try:
                handle = ckpt.save(1, state)
            except RuntimeError as exc:
                # Not chained: its traceback holds views of the pool, which is
                # unmapped once the checkpointer closes; printing them would crash.
                raise AssertionError(f"staging refused a view: {exc}") from None
            sent.append(handle.wait(timeout=30).chunks_sent)
            assert (handle.pieces > 1) == (budget is not None)
            assert_bitwise(restored(ckpt, 1), expected)
    assert sent[0] > 0 and sent[1] == 0  # whole, the same chunks as in pieces


def test_a_budget_below_one_chunk_is_refused(url: str, shm: Path) -> None:
    with pytest.raises(InvalidRequest):
        Checkpointer(url, "tiny", chunk_size=8192, staging_budget=8192, shm_dir=shm)
    assert files(shm) == []


def test_a_state_that_grows_adds_one_segment_and_keeps_the_old_one(
    shm: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = CountingSegments(monkeypatch)
    g = torch.Generator().manual_seed(6)
    model = {f"layer{i}": torch.randn(100_000, generator=g) for i in range(5)}  # 2 MB
    with Checkpointer(url, "grow", chunk_size=CS, shm_dir=shm) as ckpt:
        ckpt.save(1, {"model": model}).wait(timeout=30)  # before the first optimizer step
        assert len(created.calls) == 1
        # The optimizer's state appears after the first step: twice the model again.
        optim = {k: {"exp_avg": v * 0.1, "exp_avg_sq": v * v} for k, v in model.items()}
        state = {"model": model, "optim": optim}
        ckpt.save(2, state).wait(timeout=30)
        assert len(created.calls) == 2 and ckpt.staging.stats.segments_removed == 0
        for step in (3, 4):
            mutate(model)
            ckpt.save(step, state).wait(timeout=30)
        assert len(created.calls) == 2
        need = 3 * 5 * 400_000
        assert need <= ckpt.staging.stats.bytes_mapped <= need + 2 * SEGMENT_GRAIN
        assert_bitwise(restored(ckpt, 4), snapshot(state))


def test_the_index_and_generation_describe_the_staged_snapshot(shm: Path, url: str) -> None:
    state = mixed_state(seed=4)
    with Checkpointer(url, "idx", chunk_size=CS, shm_dir=shm) as ckpt:
        g0 = ckpt.staging.generation
        ckpt.save(5, state).wait(timeout=30)
        assert ckpt.staging.generation == g0 + 2
        reader = StagingPool.open_existing("idx", 0, shm)
        assert reader is not None
        with reader:
            assert (reader.step, reader.state) == (5, "staged") and reader.consistent()
            seen = {}
            for name, number, cid, data in reader.chunks():
                assert chunk_id(data) == cid
                seen[(name, number)] = cid
            assert ("f64", 0) in seen and ("bf16", 12) in seen
            manifest = asyncio.run(_manifest(ckpt, 5))
            for e in manifest.entries:
                assert [seen[(e.name, k)] for k in range(len(e.chunks))] == e.chunks
            mutate(state)
            ckpt.save(6, state).wait(timeout=30)
            assert not reader.consistent()  # it still holds step 5's index: stale now
        with StagingPool.open_existing("idx", 0, shm) as reader:  # type: ignore[union-attr]
            assert reader.step == 6 and reader.consistent()
            assert reader.generation() == g0 + 4


async def _manifest(ckpt: Checkpointer, step: int) -> Any:
    return await ckpt.transport.read_manifest(ckpt.job, step, ckpt.rank)


def test_two_live_pools_with_one_name_use_separate_directories(
    shm: Path, tmp_path: Path
) -> None:
    a = Checkpointer(f"file://{tmp_path / 'a'}", "same", shm_dir=shm)
    b = Checkpointer(f"file://{tmp_path / 'b'}", "same", shm_dir=shm)
    try:
        assert a.staging.directory == pool_dir("same", 0, shm)
        assert b.staging.directory != a.staging.directory
        sa, sb = {"w": torch.ones(1000)}, {"w": torch.zeros(1000)}
        ha, hb = a.save(1, sa), b.save(1, sb)
        ha.wait(timeout=30)
        hb.wait(timeout=30)
        assert_bitwise(restored(a, 1), sa)
        assert_bitwise(restored(b, 1), sb)
    finally:
        a.close()
        b.close()
    assert files(shm) == []


def test_a_full_shm_dir_falls_back_to_private_memory(
    shm: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(shm)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full)
    state = mixed_state(seed=5)
    with Checkpointer(url, "full", chunk_size=CS, shm_dir=shm) as ckpt:
        ckpt.save(1, state).wait(timeout=30)
        assert ckpt.staging.stats.fallback_segments == 1
        assert not any(n.startswith("seg-") for n in os.listdir(ckpt.staging.directory))
        assert_bitwise(restored(ckpt, 1), state)
    assert files(shm) == []


# -- what outlives the process ------------------------------------------------------------

CHILD = """
import os, sys, torch
from ckptd.client import Checkpointer, Shard
how = sys.argv[1]
g = torch.Generator().manual_seed(7)
state = {"w": torch.randn(5000, generator=g), "b": torch.arange(10)}
ckpt = Checkpointer(sys.argv[2], "crash", chunk_size=4096, shm_dir=sys.argv[3])
ckpt.save(3, state).wait(timeout=30)
if how == "close":
    ckpt.close()
elif how == "os._exit":
    os._exit(0)
elif how == "raise":
    raise ValueError("the training loop failed")
elif how == "interrupt":
    raise KeyboardInterrupt
elif how == "fork":  # a child that ends normally (its atexit hooks run), then a crash
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    os._exit(0)
# "exit": a normal interpreter exit without close()
"""


def run_child(how: str, url: str, shm: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), how, url, str(shm)],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode == 0) == (how in ("close", "exit", "os._exit", "fork")), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "exit", "interrupt"])
def test_a_process_that_ends_normally_leaves_nothing(how: str, shm: Path, url: str) -> None:
    run_child(how, url, shm)
    assert files(shm) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["os._exit", "raise", "fork"])
def test_a_crashed_process_leaves_its_snapshot_for_the_restart(
    how: str, shm: Path, url: str
) -> None:
    """(fork: a forked child, a DataLoader worker or a user's own, holds copies of
    its parent's pools, not pools of its own: its normal exit removed them.)"""
    run_child(how, url, shm)
    left = files(shm)
    assert any("seg-" in f for f in left) and any(f.endswith("index.json") for f in left)
    g = torch.Generator().manual_seed(7)
    expected = {"w": torch.randn(5000, generator=g), "b": torch.arange(10)}
    with Checkpointer(url, "crash", chunk_size=4096, shm_dir=shm) as ckpt:
        # The restarted worker finds the old pool and every chunk of the commit in it.
        manifest = asyncio.run(_manifest(ckpt, 3))
        reader = StagingPool.open_existing("crash", 0, shm)
        assert reader is not None and reader.step == 3 and reader.consistent()
        with reader:
            held = {cid: bytes(data) for _, _, cid, data in reader.chunks()}
        for e in manifest.entries:
            view = byte_view(expected[e.name])
            assert b"".join(held[c] for c in e.chunks) == bytes(view)
        # Its first save takes the directory over: the old segments go.
        old = {f for f in os.listdir(ckpt.staging.directory) if f.startswith("seg-")}
        ckpt.save(4, expected).wait(timeout=30)
        now = {f for f in os.listdir(ckpt.staging.directory) if f.startswith("seg-")}
        assert old and now and not old & now
    assert files(shm) == []


@pytest.mark.slow
def test_remove_stale_pools_keeps_live_ones(shm: Path, url: str) -> None:
    run_child("os._exit", url, shm)
    with Checkpointer(url, "live", shm_dir=shm) as ckpt:
        ckpt.save(1, {"w": torch.ones(10)}).wait(timeout=30)
        removed = remove_stale_pools(shm)
        assert removed == [pool_dir("crash", 0, shm)]
        assert ckpt.staging.directory.is_dir()
    assert files(shm) == []


def test_explicit_placements_win_over_dtensor_layouts_which_win_over_the_default(
    shm: Path, url: str
) -> None:
    tensors = [(n, torch.zeros(2, 3)) for n in ("explicit", "local", "dtensor", "plain")]
    layouts: dict[str, Any] = {
        "explicit": ("sharded", [4, 3], [2, 0]),
        "local": ("sharded", [4, 3], [0, 0]),
        "dtensor": ("sharded", [2, 6], [0, 3]),
    }
    with Checkpointer(url, "place", shm_dir=shm, default_placement="local") as ckpt:
        got = placements(tensors, {"explicit": Shard((6, 3), (4, 0))}, ["local"], layouts,
                         ckpt.default_placement)
        assert got == {
            "explicit": ("sharded", [6, 3], [4, 0]),
            "local": ("local", [2, 3], [0, 0]),
            "dtensor": ("sharded", [2, 6], [0, 3]),
            "plain": ("local", [2, 3], [0, 0]),
        }
        with pytest.raises(InvalidRequest):
            placements(tensors, {}, [], {"plain": ("sharded", [2, 3], [1, 0])},
                       ckpt.default_placement)
