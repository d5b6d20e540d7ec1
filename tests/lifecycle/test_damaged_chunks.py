"""The chunks scrub marked, as saves see them (``DamagedChunks``): read at once the
first time and after ``forget``; once old, read again in the background while the
set held answers, so a save's missing-chunks call never waits on the listing of
every job's markers (one request per job on S3)."""

from __future__ import annotations

import asyncio

from ckptd.lifecycle.damaged_chunks import DamagedChunks
from ckptd.lifecycle.documents import damage_prefix
from ckptd.lifecycle.scrub import scrub
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from tests.lifecycle.test_scrub import JOB, _corrupt, _steps


async def test_an_old_set_answers_at_once_and_is_read_again_behind_it() -> None:
    repo = Repository(MemoryStore())
    ids = await _steps(repo, 1)
    damaged = DamagedChunks(repo, ttl=0.0)
    assert await damaged.ids() == frozenset()  # (the first: read now)
    await _corrupt(repo.store, ids[1][0])
    assert (await scrub(repo)).damaged == {JOB: [1]}
    assert await damaged.ids() == frozenset()  # the set held, its reading behind it
    assert damaged._again is not None
    await asyncio.wait_for(damaged._again, 10)
    assert await damaged.ids() == {ids[1][0]}


class _HeldListing(MemoryStore):
    """A store whose next listing of damage markers answers what it found, but only
    once ``release`` is set: a reading of the markers still in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def list_dir(self, prefix: str) -> list[str]:
        found = await super().list_dir(prefix)
        if self.hold and prefix == damage_prefix(JOB):
            self.hold = False
            self.entered.set()
            await self.release.wait()
        return found


async def test_a_forget_while_a_reading_is_in_flight_is_not_lost() -> None:
    # A scrub here marks a chunk and forgets the set while a background reading, begun
    # before the marker was written, is still out: that reading must not stand as
    # fresh, or saves deduplicate against the corrupt chunk for another ``ttl``.
    store = _HeldListing()
    repo = Repository(store)
    ids = await _steps(repo, 1)
    damaged = DamagedChunks(repo, ttl=0.2)
    assert await damaged.ids() == frozenset()
    await asyncio.sleep(0.25)
    store.hold = True
    assert await damaged.ids() == frozenset()  # the old set; a reading behind it
    await asyncio.wait_for(store.entered.wait(), 10)
    await _corrupt(store, ids[1][0])
    assert (await scrub(repo)).damaged == {JOB: [1]}
    damaged.forget()
    store.release.set()
    assert damaged._again is not None
    await asyncio.wait_for(damaged._again, 10)
    assert await damaged.ids() == {ids[1][0]}
