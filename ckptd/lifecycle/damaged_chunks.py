"""The chunks scrub found corrupt and could not repair (those its damage markers
name), as saves meet them: the store holds such a chunk, but not its bytes.

- A save asking which of its chunks are missing is told these are (``sound``), so
  it uploads them; that upload, verified like any other, replaces the corrupt copy
  and takes the chunk out of the markers (``uploaded``): the steps that named it
  are whole again. Without it a new step deduplicated against the corrupt copy and
  committed as ``latest`` on bytes scrub had already found bad.
- The markers are read again every ``DAMAGED_TTL_S`` (others mark too: ``ckptd
  scrub`` on the store, another replica); a commit reads its own job's at once
  (``check_commit``), and refuses a step naming a chunk still corrupt
  (``MissingChunks``: the next save sends it).

A repository holding one (``Repository.damaged``) asks it; a server's and a
``file://`` client's do."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptd.errors import MissingChunks, NotFound, StoreCorrupt
from ckptd.format import chunk_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.scrub import (
    ChunkSource,
    damage_markers,
    damaged_steps,
    repair_chunk,
    settle_damage,
)

if TYPE_CHECKING:
    from ckptd.repository import Repository

log = logging.getLogger(__name__)

# How long the markers read are taken as the store's.
DAMAGED_TTL_S = 10.0


class DamagedChunks:
    """The chunk ids the store's damage markers name. Read at the first ``ids`` and
    after ``forget``; once ``ttl`` seconds old, read again in the background while
    the set held answers: a missing-chunks call (a save) never waits on the listing
    of every job's markers, one request per job on S3 (at most one reading at a
    time)."""

    def __init__(self, repo: Repository, ttl: float = DAMAGED_TTL_S) -> None:
        self.repo = repo
        self.ttl = ttl
        self._ids: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()
        self._again: asyncio.Task[None] | None = None
        self._forgotten = 0  # (a reading begun before a ``forget`` is not fresh)

    async def ids(self) -> frozenset[str]:
        if self._read_at == float("-inf"):  # (never read, or forgotten: now)
            await self._read()
        elif time.monotonic() - self._read_at >= self.ttl and (
                self._again is None or self._again.done()):
            self._again = asyncio.get_running_loop().create_task(self._read_quietly())
        return self._ids

    async def _read(self) -> None:
        async with self._lock:
            started, forgotten = time.monotonic(), self._forgotten
            self._ids = frozenset(
                [cid async for _, _, doc in damage_markers(self.repo) for cid in doc.chunks])
            if forgotten == self._forgotten:
                self._read_at = started

    async def _read_quietly(self) -> None:
        try:
            await self._read()
        except Exception as exc:  # (the store's hiccup: the set held stands, tried again)
            log.warning("reading the store's damage markers failed: %s", exc)

    def forget(self) -> None:
        """The next ``ids`` reads the markers (a scrub here marked or healed), even
        when a reading was in flight: it may have listed them before the change."""
        self._read_at = float("-inf")
        self._forgotten += 1

    async def sound(self, ids: Sequence[str], present: list[bool]) -> list[bool]:
        """``present`` (of ``ids``) less the chunks marked corrupt."""
        damaged = await self.ids()
        if not damaged:
            return present
        return [ok and cid not in damaged for cid, ok in zip(ids, present, strict=True)]

    async def uploaded(self, cid: str, good: bytes | memoryview) -> None:
        """An upload of ``cid`` the store held already (``good``: its bytes, verified):
        when ``cid`` is marked, they replace the stored copy, and the markers drop it."""
        if cid in await self.ids():
            await self.repair(cid, good)

    async def repair(self, cid: str, good: bytes | memoryview) -> bool:
        """Replaces the stored copy of ``cid`` with ``good`` (bytes that hash to it)
        unless it reads good already, and takes it out of the markers naming it;
        True when the store holds good bytes of it now."""
        store = self.repo.store
        read_at = time.time()
        try:
            bad: bytes | None = await store.get(chunk_key(cid))
        except (NotFound, StoreCorrupt):  # (gone, or there but unreadable: replaced)
            bad = None
        if bad is not None and await asyncio.to_thread(chunk_id, bad) == cid:
            repaired = True  # (repaired meanwhile, or put back by hand)
        else:
            repaired = await repair_chunk(store, cid, bad, [_bytes_of(good)])
        if repaired:
            settled = await settle_damage(self.repo, {}, {cid: read_at})
            for job, steps in settled.whole.items():
                log.warning("an upload of chunk %s repaired it: steps %s of %s are whole "
                            "again", cid, steps, job)
            self.forget()
        return repaired

    async def check_commit(self, job: str, step: int, ids: Sequence[str]) -> None:
        """Before ``step`` of ``job`` (naming chunks ``ids``) commits: ``MissingChunks``
        when one of them is marked corrupt (the markers of ``job`` read now, the
        others' within ``ttl``) and still reads corrupt."""
        fresh = {cid for chunks in (await damaged_steps(self.repo, job)).values()
                 for cid in chunks}
        if fresh - self._ids:  # (the next save's missing chunks include them now)
            self._ids = self._ids | fresh
        suspect = (fresh | await self.ids()).intersection(ids)
        if not suspect:
            return
        bad = [cid for cid in sorted(suspect) if not await self._reads_good(cid)]
        if bad:
            raise MissingChunks(
                f"step {step} of {job} names {len(bad)} chunks whose stored copy scrub found "
                "corrupt; it is not committed: the next save sends them again, which "
                "repairs them", ids=bad[:20], job=job, step=step)

    async def _reads_good(self, cid: str) -> bool:
        try:
            data = await self.repo.store.get(chunk_key(cid))
        except (NotFound, StoreCorrupt):
            return False
        return await asyncio.to_thread(chunk_id, data) == cid


def _bytes_of(good: bytes | memoryview) -> ChunkSource:
    async def source(cid: str) -> bytes | None:
        return bytes(good)

    return source
