"""Scrub takes chunks it finds good out of the damage markers, by compare-and-swap
against what it read: a chunk another scrub marks meanwhile stays marked."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ckptd.format import chunk_key
from ckptd.lifecycle.documents import Damage, damage_key
from ckptd.lifecycle.scrub import damaged_steps, mark_damage, scrub
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from tests.lifecycle.test_scrub import JOB, _corrupt, _steps


class RacingStore(MemoryStore):
    """Runs ``meanwhile`` (once) just before the first conditional write of a damage
    marker: another scrub's marking, landing between this one's read and write."""

    meanwhile: Callable[[], Awaitable[object]] | None = None

    async def _race(self, key: str) -> None:
        if "/damage/" in key and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            await run()

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        await self._race(key)
        return await super().compare_and_swap(key, expected, new)

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        await self._race(key)
        return await super().compare_and_delete(key, expected)


async def test_a_chunk_marked_while_scrub_clears_the_marker_stays_marked() -> None:
    store = RacingStore()
    repo = Repository(store)
    ids = await _steps(repo, 1)
    fixed, other = ids[1][:2]
    good = await _corrupt(store, fixed)
    assert (await scrub(repo)).damaged == {JOB: [1]}
    assert await damaged_steps(repo, JOB) == {1: [fixed]}
    assert await store.compare_and_swap(chunk_key(fixed), (await store.get(chunk_key(fixed))),
                                        good)  # put back by hand
    # Another scrub marks ``other`` as this one takes ``fixed`` out (found earlier
    # than the good read of ``fixed``: that one goes, ``other`` stays).
    store.meanwhile = lambda: mark_damage(repo, {other}, 0.0)
    report = await scrub(repo)
    assert report.corrupt == [] and report.whole_again == {}
    marker = Damage.parse(await store.get(damage_key(JOB, 1)))
    assert marker.chunks == [other]
    assert await repo.latest(JOB) is None  # (its only step, still damaged)


async def test_a_chunk_read_good_before_it_was_marked_again_stays_marked() -> None:
    """(A good read older than the marker's found_at may predate a bad one.)"""
    store = RacingStore()
    repo = Repository(store)
    ids = await _steps(repo, 1)
    fixed = ids[1][0]
    good = await _corrupt(store, fixed)
    await scrub(repo)
    assert await store.compare_and_swap(chunk_key(fixed), (await store.get(chunk_key(fixed))),
                                        good)
    store.meanwhile = lambda: mark_damage(repo, {ids[1][1]}, 2e9)  # found later
    report = await scrub(repo, clock=lambda: 1.9e9)
    assert report.whole_again == {}
    marker = Damage.parse(await store.get(damage_key(JOB, 1)))
    assert marker.chunks == sorted([fixed, ids[1][1]])
    store.meanwhile = None
    assert (await scrub(repo, clock=lambda: 2.1e9)).whole_again == {JOB: [1]}
    assert await damaged_steps(repo, JOB) == {} and await repo.latest(JOB) == 1
