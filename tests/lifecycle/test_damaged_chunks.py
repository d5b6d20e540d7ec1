"""The chunks scrub marked, as saves see them (``DamagedChunks``): read at once the
first time and after ``forget``; once old, read again in the background while the
set held answers, so a save's missing-chunks call never waits on the listing of
every job's markers (one request per job on S3)."""

from __future__ import annotations

import asyncio

from ckptd.lifecycle.damaged_chunks import DamagedChunks
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
