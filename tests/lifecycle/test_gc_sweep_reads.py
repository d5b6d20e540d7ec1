"""The sweep phase's reads (touched documents, new and pending manifests) keep the
lease and keep writers' waits short: touched documents are read while marking and
a few at a time, the lease is renewed while they are read, and a collection that
fails hands the lease back (the reviewer's gc_sweep_reads.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from ckptd.errors import GcInProgress
from ckptd.format import chunk_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState, GcTouched, touched_prefix
from ckptd.lifecycle.fence import read_state
from ckptd.lifecycle.gc import collect_garbage
from ckptd.repository import Repository
from ckptd.store import MemoryStore

ORPHAN = b"an orphan chunk"


class SlowTouched(MemoryStore):
    """Every read of a touched document takes ``seconds`` (an object store's GET)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.late_touched = 0  # touched documents written just before the sweep

    async def get(self, key: str) -> bytes:
        if key.startswith("gc/touched/"):
            await asyncio.sleep(self.seconds)
        return await super().get(key)

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        if key == GC_STATE_KEY and self.late_touched:
            state = GcState.parse(new)
            if state.phase == "sweeping":  # missing-chunks calls that just made it
                for _ in range(self.late_touched):
                    doc = GcTouched(generation=state.generation, ids=["cd" * 32]).canonical()
                    await self.put_if_absent(
                        f"{touched_prefix(state.generation)}{uuid.uuid4().hex}", doc)
                self.late_touched = 0
        return await super().compare_and_swap(key, expected, new)


async def _sweeping_or_done(store: MemoryStore, gc: asyncio.Task[object]) -> None:
    while not gc.done() and (await read_state(store))[0].phase != "sweeping":
        await asyncio.sleep(0.005)


async def test_touched_reads_do_not_outlast_the_lease_or_hold_writers() -> None:
    """Lease 2 s, 60 touched documents at 40 ms a read (2.4 s one at a time): the
    collection finishes, and a writer during the sweep phase waits far less than
    the lease."""
    store = SlowTouched(0.04)
    repo = Repository(store)
    await repo.put_chunk(chunk_id(ORPHAN), ORPHAN)
    gc = asyncio.create_task(collect_garbage(store, grace=0.3, lease=2.0))
    await asyncio.sleep(0.05)
    for i in range(60):  # marking: 60 missing-chunks calls leave 60 touched documents
        await repo.missing_chunks(["ab" * 32], claimer=f"r{i}")
    await asyncio.wait_for(_sweeping_or_done(store, gc), 10)
    t0 = time.monotonic()
    await repo.missing_chunks(["cd" * 32])
    waited = time.monotonic() - t0
    report = await asyncio.wait_for(gc, 10)
    assert report.chunks_deleted == 1 and report.touched == 1
    assert waited < 1.0, waited
    assert (await read_state(store))[0].phase == "idle"


async def test_the_lease_is_renewed_while_the_sweep_reads() -> None:
    """40 touched documents land just before the sweep, each read taking 0.3 s:
    0.9 s of reads, 16 at a time, more than twice the 0.4 s lease."""
    store = SlowTouched(0.3)
    store.late_touched = 40
    repo = Repository(store)
    await repo.put_chunk(chunk_id(ORPHAN), ORPHAN)
    report = await asyncio.wait_for(collect_garbage(store, grace=0.0, lease=0.4), 20)
    assert report.chunks_deleted == 1 and report.touched == 1
    assert (await read_state(store))[0].phase == "idle"


class PausedAtSweep(MemoryStore):
    """The collector's clock jumps a whole lease once it switched to sweeping (its
    host paused): it is out of lease time before its first delete."""

    def __init__(self, lease: float) -> None:
        super().__init__()
        self.lease = lease
        self.jump = 0.0

    def clock(self) -> float:
        return time.time() + self.jump

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        swapped = await super().compare_and_swap(key, expected, new)
        if key == GC_STATE_KEY and GcState.parse(new).phase == "sweeping":
            self.jump = self.lease
        return swapped


async def test_a_collection_out_of_lease_time_hands_the_lease_back() -> None:
    """Nothing was deleted and no delete is under way: writers need not wait out
    the lease (and its margin) of a collector that stopped."""
    store = PausedAtSweep(lease=30.0)
    repo = Repository(store)
    await repo.put_chunk(chunk_id(ORPHAN), ORPHAN)
    with pytest.raises(GcInProgress):
        await collect_garbage(store, grace=0.0, lease=30.0, clock=store.clock)
    assert await store.exists(chunk_key(chunk_id(ORPHAN)))
    assert (await read_state(store))[0].phase == "idle"
    await asyncio.wait_for(repo.missing_chunks(["ab" * 32]), 5)  # a writer goes on at once


async def test_a_collection_under_way_elsewhere_is_said_with_what_to_do() -> None:
    """(Found by a probe.) A direct ``ckptd gc`` while a server's collection marks
    said only "garbage collection 6 is already marking (until 58 s from now)"."""
    store = MemoryStore()
    held = GcState(generation=6, phase="marking", holder="a server", started_at=time.time(),
                   expires_at=time.time() + 60)
    assert await store.put_if_absent(GC_STATE_KEY, held.canonical())
    with pytest.raises(GcInProgress) as raised:
        await collect_garbage(store, grace=0.0)
    said = raised.value.message
    assert "garbage collection 6 is already marking" in said
    assert "once it ended" in said and "--url http://" in said
