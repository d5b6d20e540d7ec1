"""What a stopped collection leaves, and what a write held by one says (an
operator's probe): a collection cancelled mid-sweep (a server's shutdown) hands its
lease back once its deletes landed; a write waiting on a collector that stopped
renewing its lease logs what it waits for and until when, and the GC state's view
says so; a collection removes a killed writer's temporaries."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from ckptd.errors import GcInProgress
from ckptd.hashing import chunk_id
from ckptd.lifecycle.documents import GC_STATE_KEY, GcState
from ckptd.lifecycle.fence import read_state
from ckptd.lifecycle.gc import GcProgress, collect_garbage, gc_state
from ckptd.repository import Repository
from ckptd.store import LocalStore, MemoryStore


class SlowDeletes(MemoryStore):
    """Every chunk delete takes ``seconds``; ``deleting`` is set at the first."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.deleting = asyncio.Event()

    async def delete(self, key: str) -> None:
        if key.startswith("chunks/"):
            self.deleting.set()
            await asyncio.sleep(self.seconds)
        await super().delete(key)


async def test_a_collection_cancelled_mid_sweep_hands_its_lease_back() -> None:
    """Before: a cancel during a delete (a server's shutdown, Ctrl-C) left the state
    'sweeping', and every write waited out the lease and its margin (~2 minutes)."""
    store = SlowDeletes(0.2)
    repo = Repository(store)
    for i in range(16):  # (all in flight at once: none waits for its turn)
        data = f"garbage {i}".encode()
        await repo.put_chunk(chunk_id(data), data)
    progress = GcProgress()
    gc = asyncio.create_task(collect_garbage(store, grace=0.0, lease=30.0, progress=progress))
    await asyncio.wait_for(store.deleting.wait(), 10)
    gc.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(gc, 10)
    state, _ = await read_state(store)
    assert state.phase == "idle", state
    assert progress.released and progress.phase == "sweeping" and progress.generation == 1
    t0 = time.monotonic()
    await repo.missing_chunks([chunk_id(b"new")])  # a write goes on at once
    assert time.monotonic() - t0 < 1.0


async def test_a_write_held_by_a_stopped_collector_says_what_it_waits_for(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: a save waited up to two minutes for a killed collector's sweep with
    nothing in any log, and the GC state's view did not say the collector stopped."""
    store = MemoryStore()
    repo = Repository(store)
    now = time.time()
    dead = GcState(generation=4, phase="sweeping", holder="killed", started_at=now - 2.0,
                   expires_at=now - 0.5)  # live for its margin: until now + 1 s
    await store.put_if_absent(GC_STATE_KEY, dead.canonical())
    view = await gc_state(store)
    assert view["collector_stopped"] is True and view["live_until"] == pytest.approx(now + 1.0)
    assert "stopped renewing its lease" in str(view["note"])
    with pytest.raises(GcInProgress) as held:
        await collect_garbage(store, grace=0.0)
    assert "collector stopped renewing its lease" in held.value.message
    assert "UTC" in held.value.message
    with caplog.at_level(logging.WARNING, logger="ckptd.lifecycle.fence"):
        await asyncio.wait_for(repo.missing_chunks([chunk_id(b"new")]), 10)
    said = [r.getMessage() for r in caplog.records if r.name == "ckptd.lifecycle.fence"]
    assert len(said) == 1, said
    assert said[0].startswith("a write waits for the store's garbage collection: garbage "
                              "collection 4's collector stopped renewing its lease"), said
    assert "UTC" in said[0]


async def test_a_collection_removes_a_killed_writers_temporaries(tmp_path: Path) -> None:
    """Before: only a server's start removed them; a store used without a server
    kept a killed writer's .tmp- files for ever (a 3-hour-old one survived gc)."""
    store = LocalStore(tmp_path / "store", fsync=False)
    folder = tmp_path / "store" / "chunks" / "ab"
    folder.mkdir(parents=True)
    stale, fresh = folder / (".tmp-" + "1" * 32), folder / (".tmp-" + "2" * 32)
    stale.write_bytes(b"half a chunk")
    fresh.write_bytes(b"a live upload's")
    three_hours_ago = time.time() - 3 * 3600
    os.utime(stale, (three_hours_ago, three_hours_ago))
    await collect_garbage(store, grace=0.0)
    assert not stale.exists() and fresh.exists()
