"""A sweep never deletes a chunk after writers may think its lease is over: a
collector whose clock runs behind the writers', or whose one delete stalls past
its lease, must not delete a chunk that a save was meanwhile told is present (the
reviewer's gc_lease_expiry.py, modes ``skew`` and ``pause``)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from ckptd.errors import GcInProgress
from ckptd.format import chunk_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState
from ckptd.lifecycle.fence import read_state, sweeping
from ckptd.lifecycle.gc import collect_garbage
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.store.base import Store
from ckptd.testing.manifests import Chunks, demo_step

JOB = "b"


class StallingStore(MemoryStore):
    """Deleting ``victim`` waits for ``gate`` or ``stall`` seconds (a slow DeleteObject)."""

    def __init__(self, victim: str, stall: float | None) -> None:
        super().__init__()
        self.victim = victim
        self.stall = stall
        self.gate = asyncio.Event()
        self.in_delete = asyncio.Event()

    async def delete(self, key: str) -> None:
        if key == self.victim:
            self.in_delete.set()
            if self.stall is not None:
                await asyncio.sleep(self.stall)
            else:
                await self.gate.wait()
        await super().delete(key)


async def _save_again(repo: Repository, manifest: object, chunks: Chunks) -> str:
    """The rank saves its step: sends only what it is told is missing, commits."""
    res = await repo.missing_chunks(sorted(chunks), claimer="r0")
    for cid in res.missing:
        await repo.put_chunk(cid, chunks[cid])
    await repo.put_manifest(manifest)  # type: ignore[arg-type]
    return (await repo.commit(JOB, 1)).state


async def _committed_step_is_whole(repo: Repository) -> None:
    report = await repo.verify(JOB, 1)
    assert report.ok, report


async def test_a_collector_whose_clock_runs_behind_still_fences_writers() -> None:
    """Skew: the collector's clock is 1.5 s behind the writers' (within its 2 s
    lease). A delete is under way when, on the writers' clock, the lease is over;
    they must still wait for the sweep, not be told the doomed chunk is present.
    (The chunks are a step's, stored by a save that never put its manifest.)"""
    (manifest, chunks), = demo_step(JOB, 1, 1, seed="x")
    victim = chunk_key(sorted(chunks)[0])
    store = StallingStore(victim, None)
    repo = Repository(store)
    for cid, data in chunks.items():
        await repo.put_chunk(cid, data)
    gc = asyncio.create_task(
        collect_garbage(store, grace=0.05, lease=2.0, clock=lambda: time.time() - 1.5))
    await asyncio.wait_for(store.in_delete.wait(), 10)
    await asyncio.sleep(1.0)  # 1 s of the lease left on its clock, none on theirs
    save = asyncio.create_task(_save_again(repo, manifest, chunks))
    await asyncio.sleep(0.3)
    answered_early = save.done()
    store.gate.set()  # the stalled delete goes through (or was given up)
    assert await asyncio.wait_for(save, 10) == "committed"
    with contextlib.suppress(GcInProgress):  # given up: it stopped short of its lease
        await asyncio.wait_for(gc, 10)
    assert not answered_early  # the save waited for the sweep
    await _committed_step_is_whole(repo)


async def test_a_delete_that_stalls_past_the_lease_is_given_up_before_writers_move_on(
) -> None:
    """Pause: one delete takes 3 s, the lease is 1 s. The collector gives the delete
    up well before its lease ends (it is not carried out), and writers wait out the
    lease and its margin; the step then commits whole."""
    (manifest, chunks), = demo_step(JOB, 1, 1, seed="x")
    victim = chunk_key(sorted(chunks)[0])
    store = StallingStore(victim, 3.0)
    repo = Repository(store)
    for cid, data in chunks.items():
        await repo.put_chunk(cid, data)
    gc = asyncio.create_task(collect_garbage(store, grace=0.05, lease=1.0))
    ended: list[float] = []
    gc.add_done_callback(lambda _: ended.append(time.monotonic()))
    await asyncio.wait_for(store.in_delete.wait(), 10)
    t0 = time.monotonic()
    await asyncio.sleep(1.1)  # the lease has run out on everyone's clock
    assert await asyncio.wait_for(_save_again(repo, manifest, chunks), 10) == "committed"
    with pytest.raises(GcInProgress):
        await asyncio.wait_for(gc, 10)
    assert ended[0] - t0 < 1.0  # it gave the delete up within its lease
    await asyncio.sleep(max(0.0, 3.2 - (time.monotonic() - t0)))  # a stalled delete's end
    await _committed_step_is_whole(repo)


class SlowDeletes(MemoryStore):
    """Every chunk delete takes ``seconds``; records how much of the stored lease
    was left when it began."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.left_at_delete: list[float] = []

    async def delete(self, key: str) -> None:
        if key.startswith("chunks/"):
            state = GcState.parse(await self.get(GC_STATE_KEY))
            self.left_at_delete.append(state.expires_at - time.time())
            await asyncio.sleep(self.seconds)
        await super().delete(key)


async def test_the_lease_is_checked_before_every_delete_not_once_per_batch() -> None:
    """64 deletes of 0.25 s each, 16 at a time, take a whole 0.8 s lease: the
    lease is renewed between them, and none begins with under a quarter left."""
    store = SlowDeletes(0.25)
    repo = Repository(store)
    for i in range(64):
        await repo.put_chunk(*_chunk(i))
    report = await asyncio.wait_for(collect_garbage(store, grace=0.0, lease=0.8), 20)
    assert report.chunks_deleted == 64
    assert len(store.left_at_delete) == 64
    assert min(store.left_at_delete) >= 0.8 / 4, sorted(store.left_at_delete)[:5]


def _chunk(i: int) -> tuple[str, bytes]:
    data = f"garbage {i}".encode()
    return chunk_id(data), data


async def test_an_expired_sweep_stays_live_for_its_margin() -> None:
    """Writers and a collector taking over count a sweep live until its lease ends,
    plus a margin at least as long as the lease."""
    store: Store = MemoryStore()
    state = GcState(generation=3, phase="sweeping", holder="x", started_at=100.0,
                    expires_at=160.0)
    assert sweeping(state, 160.5) and sweeping(state, 219.0)
    assert not sweeping(state, 221.0)
    await store.put_if_absent(GC_STATE_KEY, state.canonical())
    with pytest.raises(GcInProgress):
        await collect_garbage(store, grace=0.0, clock=lambda: 200.0)
    report = await collect_garbage(store, grace=0.0, clock=lambda: 221.0)
    assert report.generation == 4
    assert (await read_state(store))[0].phase == "idle"


async def test_a_long_sweeps_margin_is_one_lease_not_its_length() -> None:
    """A sweep that ran an hour and then died must not keep writers waiting another
    hour: the margin after its lease is one lease, however long it swept."""
    from ckptd.lifecycle.fence import sweep_live_until
    from ckptd.lifecycle.gc import _Lease

    store = MemoryStore()
    now = [1000.0]
    lease = _Lease(store, 60.0, lambda: now[0])
    await lease.acquire()
    await lease.move("sweeping")
    for _ in range(100):  # an hour of renewals
        now[0] += 36.0
        await lease.move("sweeping")
    state = (await read_state(store))[0]
    assert state.phase == "sweeping"
    assert sweep_live_until(state) == state.expires_at + 60.0
