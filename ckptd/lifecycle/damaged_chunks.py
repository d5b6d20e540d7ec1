"""The chunks scrub found corrupt and could not repair (those its damage markers
name), as a server's dedup must see them: the store holds such a chunk, but not its
bytes. A save asking which of its chunks are missing is told these are, so it
uploads them; that upload, verified like any other, replaces the corrupt copy and
takes the chunk out of the markers, and the steps that named it are whole again.
Without it a new step deduplicated against the corrupt copy and committed as
``latest`` on bytes scrub had already found bad."""

from __future__ import annotations

import asyncio
import logging
import time

from ckptd.errors import NotFound, StoreCorrupt
from ckptd.format import chunk_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.scrub import ChunkSource, damage_markers, repair_chunk, settle_damage
from ckptd.repository import Repository

log = logging.getLogger(__name__)

# How long the markers read are taken as the store's: others mark too (``ckptd
# scrub``, another replica), and a save deduplicates against what this says.
DAMAGED_TTL_S = 10.0


class DamagedChunks:
    """The chunk ids the store's damage markers name, read again after ``ttl``
    seconds (at most one reading at a time)."""

    def __init__(self, repo: Repository, ttl: float = DAMAGED_TTL_S) -> None:
        self.repo = repo
        self.ttl = ttl
        self._ids: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def ids(self) -> frozenset[str]:
        if time.monotonic() - self._read_at < self.ttl:
            return self._ids
        async with self._lock:
            if time.monotonic() - self._read_at >= self.ttl:
                started = time.monotonic()
                self._ids = frozenset(
                    [cid async for _, _, doc in damage_markers(self.repo) for cid in doc.chunks])
                self._read_at = started
        return self._ids

    def forget(self) -> None:
        """The next ``ids`` reads the markers (this server's scrub marked or healed)."""
        self._read_at = float("-inf")

    async def repair(self, cid: str, good: bytes | memoryview) -> bool:
        """Replaces the stored copy of damaged chunk ``cid`` with ``good`` (bytes
        that hash to it: an upload's, verified already) and takes it out of the
        markers naming it; True when the store holds good bytes of it now."""
        store = self.repo.store
        read_at = time.time()
        try:
            bad: bytes | None = await store.get(chunk_key(cid))
        except NotFound:
            bad = None
        except StoreCorrupt:  # (there, but does not read: replaced)
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


def _bytes_of(good: bytes | memoryview) -> ChunkSource:
    async def source(cid: str) -> bytes | None:
        return bytes(good)

    return source
