"""A chunk upload that finds its chunk already stored (garbage a collection is about
to sweep) keeps it: the save that sent it commits instead of failing with
``missing_chunks`` once the sweep deleted the chunk it had just "uploaded"."""

from __future__ import annotations

import asyncio

from ckptd.hashing import chunk_id
from ckptd.lifecycle.gc import GcReport, collect_garbage
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.testing.manifests import demo_step
from tests.lifecycle.gated import GatedStore, actor

JOB = "job"


class HeldStore(GatedStore):
    """Holds an actor before its n-th call of one operation on one key prefix, as
    many holds at once as the test sets."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.holds: dict[tuple[str, str, str, int], tuple[asyncio.Event, asyncio.Event]] = {}
        self.seen: dict[tuple[str, str, str], int] = {}

    def hold(self, who: str, op: str, prefix: str, nth: int = 1
             ) -> tuple[asyncio.Event, asyncio.Event]:
        """(reached, release) of a hold before ``who``'s ``nth`` ``op`` on ``prefix``."""
        events = self.holds[(who, op, prefix, nth)] = (asyncio.Event(), asyncio.Event())
        return events

    async def _gate(self, op: str, key: str) -> None:
        await super()._gate(op, key)
        who = actor.get()
        for (h_who, h_op, prefix, nth), (reached, release) in self.holds.items():
            if (h_who, h_op) == (who, op) and key.startswith(prefix):
                n = self.seen[(who, op, prefix)] = self.seen.get((who, op, prefix), 0) + 1
                if n == nth:
                    reached.set()
                    await release.wait()


async def test_an_upload_of_a_chunk_a_sweep_is_deleting_keeps_it() -> None:
    """The window: a missing-chunks call reads the GC state while marking; the
    collection moves to sweeping and reads its touched ids before the call records
    its own; the call then answers every id missing (the state changed), and the
    client's upload of a chunk that is stored (garbage, doomed) was a no-op."""
    store = HeldStore(MemoryStore())
    actor.set("setup")
    repo = Repository(store)
    parts = demo_step(JOB, 1, 2)
    manifest0, chunks0 = parts[0]
    stored = sorted(chunks0)[::2]  # garbage now: no manifest names them yet
    for cid in stored:
        await repo.put_chunk(cid, chunks0[cid])

    to_sweep = store.hold("gc", "compare_and_swap", "gc/state", 2)  # marking -> sweeping
    reread = store.hold("gc", "list_prefix", "jobs/", 2)  # after it read the touched ids
    ask = store.hold("save", "exists_many", "chunks/")  # after it read the state

    async def gc() -> GcReport:
        actor.set("gc")
        return await collect_garbage(store, grace=0.0, lease=30.0)

    async def save() -> str:
        actor.set("save")
        for manifest, chunks in parts:
            answer = await repo.missing_chunks(sorted(chunks), claimer=f"r{manifest.rank}")
            for cid in answer.missing:
                await repo.put_chunk(cid, chunks[cid])
            await repo.put_manifest(manifest)
        return (await repo.commit(JOB, 1)).state

    collection = asyncio.create_task(gc())
    await asyncio.wait_for(to_sweep[0].wait(), 10)  # marking, about to sweep
    saving = asyncio.create_task(save())
    await asyncio.wait_for(ask[0].wait(), 10)  # the save read "marking"
    to_sweep[1].set()
    await asyncio.wait_for(reread[0].wait(), 10)  # sweeping; touched ids read (none)
    ask[1].set()
    await asyncio.sleep(0.3)  # the save answers "all missing" and uploads (or waits)
    reread[1].set()
    report = await asyncio.wait_for(collection, 30)
    assert set(stored) <= set(report.deleted)  # the window was hit: the sweep took them
    assert await asyncio.wait_for(saving, 30) == "committed"
    actor.set("check")
    assert (await repo.verify(JOB, 1)).ok
    assert all([await store.exists(f"chunks/{c[:2]}/{c}") for c in stored])
    assert chunk_id(chunks0[stored[0]]) == stored[0]
