"""Scrub takes chunks it finds good out of the damage markers, by compare-and-swap
against what it read: a chunk another scrub marks meanwhile stays marked, and so
does one read bad again after a good read; a step with a chunk found good and
another found bad keeps its marker throughout."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ckptd.format import chunk_key
from ckptd.lifecycle.documents import Damage, damage_key
from ckptd.lifecycle.scrub import damaged_steps, scrub, settle_damage
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from tests.lifecycle.test_scrub import JOB, _corrupt, _steps


class RacingStore(MemoryStore):
    """Runs ``meanwhile`` (once) just before the first conditional write of a damage
    marker: another scrub's marking, landing between this one's read and write."""

    meanwhile: Callable[[], Awaitable[object]] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.marker_there: list[bool] = []  # after each damage marker write: is it there

    async def _race(self, key: str) -> None:
        if "/damage/" in key and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            await run()

    async def compare_and_swap(self, key: str, expected: bytes | None, new: bytes) -> bool:
        await self._race(key)
        done = await super().compare_and_swap(key, expected, new)
        if done and "/damage/" in key:
            self.marker_there.append(await self.exists(key))
        return done

    async def compare_and_delete(self, key: str, expected: bytes) -> bool:
        await self._race(key)
        done = await super().compare_and_delete(key, expected)
        if done and "/damage/" in key:
            self.marker_there.append(await self.exists(key))
        return done


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
    store.meanwhile = lambda: settle_damage(repo, {other: 0.0}, {})
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
    store.meanwhile = lambda: settle_damage(repo, {ids[1][1]: 2e9}, {})  # found later
    report = await scrub(repo, clock=lambda: 1.9e9)
    assert report.whole_again == {}
    marker = Damage.parse(await store.get(damage_key(JOB, 1)))
    assert marker.chunks == sorted([fixed, ids[1][1]])
    store.meanwhile = None
    assert (await scrub(repo, clock=lambda: 2.1e9)).whole_again == {JOB: [1]}
    assert await damaged_steps(repo, JOB) == {} and await repo.latest(JOB) == 1


async def test_a_step_with_one_chunk_healed_and_another_corrupt_keeps_its_marker() -> None:
    """(Found by review: a scrub took the healed chunk out first, deleting the
    marker and saying the step whole again, then marked the new one: a restore of
    latest in between took the damaged step, and a server stopping there left it
    unmarked until a later pass. The report said the step damaged and whole again.)"""
    store = RacingStore()
    repo = Repository(store)
    ids = await _steps(repo, 1)
    fixed, broken = ids[1][:2]
    good = await _corrupt(store, fixed)
    assert (await scrub(repo)).damaged == {JOB: [1]}
    assert await store.compare_and_swap(chunk_key(fixed), (await store.get(chunk_key(fixed))),
                                        good)  # put back by hand
    await _corrupt(store, broken)
    store.marker_there.clear()
    report = await scrub(repo)
    assert sorted(report.corrupt) == [broken]
    assert report.damaged == {JOB: [1]} and report.whole_again == {}
    assert store.marker_there == [True]  # one write: the marker was never gone
    assert await damaged_steps(repo, JOB) == {1: [broken]}
    assert await repo.latest(JOB) is None


async def test_a_chunk_corrupt_again_after_a_repair_is_not_dropped_by_an_older_good_read() -> None:
    """(Found by review: a listed chunk read bad again left the marker as it was, its
    found_at the first bad read's; another scrub's good read made before the new
    bad read, but after the first, then took it out, and the step, still corrupt,
    was whole again.)"""
    store = RacingStore()
    repo = Repository(store)
    ids = await _steps(repo, 1)
    chunk = ids[1][0]
    good = await _corrupt(store, chunk)
    await scrub(repo, clock=lambda: 1e9)
    assert Damage.parse(await store.get(damage_key(JOB, 1))).found_at == 1e9
    assert await store.compare_and_swap(chunk_key(chunk), (await store.get(chunk_key(chunk))),
                                        good)  # repaired by hand

    async def corrupted_again_and_read_bad() -> None:
        await _corrupt(store, chunk)
        assert (await scrub(repo, clock=lambda: 2e9)).damaged == {JOB: [1]}

    # A scrub reads the chunk good at 1.5e9; as it takes it out, the chunk is
    # corrupted again and another scrub reads it bad at 2e9.
    store.meanwhile = corrupted_again_and_read_bad
    report = await scrub(repo, clock=lambda: 1.5e9)
    assert store.meanwhile is None and report.corrupt == []
    assert report.whole_again == {}
    marker = Damage.parse(await store.get(damage_key(JOB, 1)))
    assert marker.chunks == [chunk] and marker.found_at == 2e9
    assert await repo.latest(JOB) is None
