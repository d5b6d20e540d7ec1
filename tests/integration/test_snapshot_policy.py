"""One snapshot per rank in flight: a save that arrives while one is uploading waits
or is skipped, by policy, and never overwrites (or doubles) the staged copy the
upload reads."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_client_common import assert_bitwise, snapshot

from ckptd.client import Checkpointer, SaveHandle
from ckptd.errors import SnapshotSkipped, Timeout, Unavailable

pytestmark = pytest.mark.timeout(60)




class GatedTransport:
    """Wraps a checkpointer's transport: chunk uploads wait at a gate the test opens,
    and the test can make chosen uploads fail. Counts the uploads whose threads
    still run (would still read the staging pool)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail_after: int | None = None
        self.started = 0
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put_chunk(self, cid: str, data: Any) -> bool:
        self.started += 1
        fail = self.fail_after is not None and self.started > self.fail_after
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.entered.set()

        def write() -> None:
            """A store writing the chunk from the pool, in a thread (as LocalStore does)."""
            try:
                self.gate.wait(30)
                if not fail:
                    time.sleep(0.2)  # still reading the pool when another upload fails
            finally:
                with self.lock:
                    self.running -= 1

        await asyncio.to_thread(write)
        if fail:
            raise Unavailable("upload refused by the test")
        return bool(await self.inner.put_chunk(cid, data))


def gated(ckpt: Checkpointer) -> GatedTransport:
    gate = GatedTransport(ckpt._transport)
    ckpt._transport = gate  # type: ignore[assignment]
    return gate


def states() -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(64, 1024, generator=g), "b": torch.arange(100), "step": 1}
    second = {"w": torch.randn(64, 1024, generator=g), "b": torch.arange(100) * 2, "step": 2}
    return first, second


def restored(ckpt: Checkpointer, step: int) -> dict[str, Any]:
    target: dict[str, Any] = {}
    ckpt.restore(target, step=step)
    return target


def test_wait_blocks_until_the_upload_in_flight_is_done_and_never_stages_twice(
    tmp_path: Path, shm: Path
) -> None:
    first, second = states()
    expected = snapshot(first), snapshot(second)
    with Checkpointer(f"file://{tmp_path}/s", "wait", chunk_size=16384, shm_dir=shm) as ckpt:
        gate = gated(ckpt)
        pool = ckpt.staging
        h1 = ckpt.save(1, first)
        assert gate.entered.wait(10)
        generation, mapped, created = pool.generation, pool.nbytes, pool.stats.segments_created
        second_handle: list[SaveHandle] = []
        t = threading.Thread(target=lambda: second_handle.append(ckpt.save(2, second)))
        t.start()
        time.sleep(0.3)
        # The second save waits: it has not touched the pool the upload reads.
        assert t.is_alive() and not h1.done()
        assert (pool.generation, pool.nbytes, pool.stats.segments_created) == (
            generation, mapped, created)
        assert pool.stats.stages == 1
        gate.gate.set()
        t.join(30)
        (h2,) = second_handle
        assert h2.waited and h2.waited_seconds >= 0.25 and not h2.skipped
        assert h1.done()  # it finished before the second staged
        assert (h1.wait(timeout=30).step, h2.wait(timeout=30).step) == (1, 2)
        assert pool.stats.peak_bytes_mapped == mapped and pool.stats.segments_created == created
        assert pool.generation == generation + 2
        assert_bitwise(restored(ckpt, 1), expected[0])
        assert_bitwise(restored(ckpt, 2), expected[1])


def test_skip_returns_at_once_and_leaves_the_staged_copy_alone(
    tmp_path: Path, shm: Path
) -> None:
    first, second = states()
    expected = snapshot(first)
    with Checkpointer(f"file://{tmp_path}/s", "skip", chunk_size=16384, on_busy="skip",
                      shm_dir=shm) as ckpt:
        gate = gated(ckpt)
        h1 = ckpt.save(1, first)
        assert gate.entered.wait(10)
        generation = ckpt.staging.generation
        h2 = ckpt.save(2, second)
        assert h2.skipped and h2.done() and not h2.waited
        assert ckpt.staging.generation == generation and ckpt.staging.stats.stages == 1
        with pytest.raises(SnapshotSkipped):
            h2.wait(timeout=1)
        h2.staged()  # nothing was staged: returns at once
        gate.gate.set()
        assert h1.wait(timeout=30).state == "committed"
        assert_bitwise(restored(ckpt, 1), expected)
        assert ckpt.latest() == 1
        # Once the upload is done the next save goes through.
        h3 = ckpt.save(3, second)
        assert not h3.skipped and h3.wait(timeout=30).step == 3


def test_wait_gives_up_after_the_timeout_without_staging(tmp_path: Path, shm: Path) -> None:
    first, second = states()
    with Checkpointer(f"file://{tmp_path}/s", "late", chunk_size=16384, timeout=0.3,
                      shm_dir=shm) as ckpt:
        gate = gated(ckpt)
        h1 = ckpt.save(1, first)
        assert gate.entered.wait(10)
        generation = ckpt.staging.generation
        with pytest.raises(Timeout):
            ckpt.save(2, second)
        assert ckpt.staging.generation == generation
        gate.gate.set()
        h1.wait(timeout=30)
        assert ckpt.save(3, second).wait(timeout=30).step == 3
        assert_bitwise(restored(ckpt, 3), second)


def test_a_failed_upload_returns_only_once_nothing_reads_the_pool(
    tmp_path: Path, shm: Path
) -> None:
    first, second = states()
    with Checkpointer(f"file://{tmp_path}/s", "fail", chunk_size=16384, shm_dir=shm) as ckpt:
        gate = gated(ckpt)
        gate.fail_after = 2  # the third upload fails while others still run
        h1 = ckpt.save(1, first)
        assert gate.entered.wait(10)
        gate.gate.set()
        with pytest.raises(Unavailable):
            h1.wait(timeout=30)
        assert gate.max_running > 1
        assert gate.running == 0  # no upload outlived the snapshot: the pool is free
        gate.fail_after = None
        assert ckpt.save(2, second).wait(timeout=30).state == "committed"
        assert_bitwise(restored(ckpt, 2), second)


def test_a_budget_split_save_waits_for_each_piece(tmp_path: Path, shm: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(40_000, generator=g)}  # 160 KB through a 40 KB pool
    expected = snapshot(state)
    with Checkpointer(f"file://{tmp_path}/s", "pieces", chunk_size=8192, shm_dir=shm,
                      staging_budget=40_000) as ckpt:
        gate = gated(ckpt)
        threading.Timer(0.3, gate.gate.set).start()
        t0 = time.perf_counter()
        handle = ckpt.save(1, state)
        # Every piece but the last was uploaded inside save(): the stall grew.
        assert time.perf_counter() - t0 >= 0.25 and handle.pieces == 5
        assert handle.stall_seconds >= 0.25
        state["w"].zero_()
        handle.wait(timeout=30)
        assert ckpt.staging.stats.peak_bytes_mapped <= 40_000
        assert_bitwise(restored(ckpt, 1), expected)
