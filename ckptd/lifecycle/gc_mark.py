"""The mark of a garbage collection: the chunks in the store, and the chunk ids
every rank manifest (committed or pending) and touched document names; a damaged
step stops the collection (docs/FORMAT.md, "Garbage collection", steps 2 - 5)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from ckptd import large_json
from ckptd.documents import document_work, parse_stored, unsupported_stored
from ckptd.errors import InvalidRequest, NotFound, StoreCorrupt, UnsupportedFormat
from ckptd.format import CommitRecord, RankManifest, commit_key, manifest_key, removal_key
from ckptd.hashing import document_hash
from ckptd.lifecycle.documents import GcTouched, touched_prefix
from ckptd.store.base import Store

_CHUNK_KEY = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})$")
_MANIFEST_KEY = re.compile(r"^jobs/([^/]+)/steps/(\d+)/ranks/\d+\.json$")
_COMMIT_KEY = re.compile(r"^jobs/([^/]+)/steps/(\d+)/commit\.json$")
_READ_CONCURRENCY = 16


async def chunks(store: Store) -> dict[str, int]:
    """Every chunk id in the store and its size."""
    out: dict[str, int] = {}
    async for info in store.list_info("chunks/"):
        m = _CHUNK_KEY.match(info.key)
        if m and m.group(2).startswith(m.group(1)):
            out[m.group(2)] = info.size
    return out


async def manifest_keys(store: Store) -> tuple[set[str], set[tuple[str, str]]]:
    """(every rank manifest key, every committed (job, step)) under ``jobs/``."""
    manifests: set[str] = set()
    committed: set[tuple[str, str]] = set()
    async for key in store.list_prefix("jobs/"):
        if _MANIFEST_KEY.match(key):
            manifests.add(key)
        elif m := _COMMIT_KEY.match(key):
            committed.add((m.group(1), m.group(2)))
    return manifests, committed


def _chunk_ids_of(data: bytes) -> set[str]:
    """The chunk ids a rank manifest names (its parse dropped once they are out)."""
    with large_json.collector_paused():
        return set(RankManifest.parse(data).chunk_ids())


def _committed_ids(data: bytes, expected: str) -> set[str] | None:
    """``_chunk_ids_of`` a committed step's manifest, or None when its bytes are not
    those its commit record names (hashed first: such bytes are not parsed)."""
    return _chunk_ids_of(data) if document_hash(data) == expected else None


def _stopped(key: str, what: str) -> StoreCorrupt:
    """A damaged step stops the collection (docs/operations.md): its chunks are
    unknown, so none may be deleted on a guess. Store damage (a 5xx naming the
    document), not the caller's request."""
    m = _MANIFEST_KEY.match(key) or _COMMIT_KEY.match(key)
    forget = (f"ckptd forget {m.group(1)} --step {m.group(2)}" if m is not None
              else "ckptd forget JOB --step STEP")
    return StoreCorrupt(f"garbage collection stopped: {what}; forget that step ({forget}), "
                        "then collect again", key=key)


@dataclass(frozen=True, slots=True)
class _Committed:
    """What the commit record of a manifest's step says of it."""

    record: str  # the commit record's key
    digest: str  # the hash of the record's bytes as read
    manifest: str  # the hash the record names for this rank's manifest


async def _commit_records(store: Store, committed: set[tuple[str, str]]
                          ) -> dict[str, _Committed]:
    """Manifest key -> what its commit record says, for every rank of every
    committed step: a committed step's manifest that is missing, or not the bytes
    its record names, stops the collection like one that does not parse (its
    chunks may be the only copy of the step, and a manifest put back from a backup
    would name chunks gone). So does a commit record that does not read back."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)
    out: dict[str, _Committed] = {}

    async def one(job: str, step: int) -> None:
        key = commit_key(job, step)
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                return  # forgotten since it was listed
        try:
            record = await document_work(CommitRecord.parse, data)
        except UnsupportedFormat as exc:  # a newer ckptd's: upgrade, never forget it
            raise unsupported_stored(exc, key) from None
        except InvalidRequest as exc:  # (a field checked as a name too: invalid_name)
            raise _stopped(key, f"commit record {key} does not parse ({exc.message})"
                           ) from None
        if record.job != job or record.step != step:  # a record copied to another key
            raise _stopped(key, f"commit record {key} names step {record.step} of "
                           f"{record.job}")
        digest = document_hash(data)
        for ref in record.manifests:
            out[manifest_key(job, step, ref.rank)] = _Committed(key, digest, ref.hash)

    await asyncio.gather(*(one(job, int(step)) for job, step in committed))
    return out


async def _still_committed(store: Store, named: _Committed) -> bool:
    """Whether the record that named a manifest is still there, the same, and no
    retention pass is removing its step: only then is the manifest's absence (or
    other bytes) damage, not a step forgotten, or forgotten and committed anew,
    since the record was read."""
    try:
        data = await store.get(named.record)
    except NotFound:
        return False
    m = _COMMIT_KEY.match(named.record)
    assert m is not None
    return (document_hash(data) == named.digest
            and not await store.exists(removal_key(m.group(1), int(m.group(2)))))


async def read_ids(store: Store, keys: set[str], into: set[str],
                   named: dict[str, _Committed] | None = None) -> int:
    """Adds the chunk ids every manifest in ``keys`` names to ``into``; ``named``
    (``_commit_records``) says which are committed, and what their bytes must be."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)
    named = named or {}

    async def one(key: str) -> None:
        committed = named.get(key)
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                if committed is not None and await _still_committed(store, committed):
                    raise _stopped(key, f"rank manifest {key}, named by its commit record "
                                   f"{committed.record}, is missing") from None
                return  # forgotten since it was listed: it protects nothing now
        try:
            # Off the event loop (a server's /healthz keeps answering while a
            # 100,000-tensor manifest parses), with no collection scanning it.
            if committed is None:
                ids = await document_work(_chunk_ids_of, data)
            else:
                found = await document_work(_committed_ids, data, committed.manifest)
                if found is None and await _still_committed(store, committed):
                    raise _stopped(key, f"rank manifest {key} is not the document its "
                                   f"commit record {committed.record} names")
                ids = found if found is not None else await document_work(_chunk_ids_of, data)
        except UnsupportedFormat as exc:  # a newer ckptd's save: upgrade, never forget it
            raise unsupported_stored(exc, key) from None
        except InvalidRequest as exc:  # (a field checked as a name too: invalid_name)
            raise _stopped(key, f"rank manifest {key} does not parse ({exc.message})"
                           ) from None
        into.update(ids)

    await asyncio.gather(*(one(k) for k in keys))
    return len(keys)


async def mark(store: Store, keys: set[str], committed: set[tuple[str, str]],
               into: set[str]) -> set[str]:
    """Reads every listed manifest and every one a commit record names (a manifest
    missing from the listing is read too: it may be damage) into ``into``; returns
    the keys read."""
    named = await _commit_records(store, committed)
    every = keys | set(named)
    await read_ids(store, every, into, named)
    return every


def is_pending(key: str, committed: set[tuple[str, str]]) -> bool:
    m = _MANIFEST_KEY.match(key)
    return m is not None and (m.group(1), m.group(2)) not in committed


async def touched_generations(store: Store) -> list[int]:
    """The generations that have touched documents."""
    return [int(name) for name in await store.list_dir("gc/touched/") if name.isdigit()]


async def touched(store: Store, generation: int, ids: set[str], seen: set[str]) -> None:
    """Adds to ``ids`` those of the generation's touched documents not in ``seen``
    (each is written once and never changed), read a few at a time."""
    sem = asyncio.Semaphore(_READ_CONCURRENCY)
    keys = [k async for k in store.list_prefix(touched_prefix(generation)) if k not in seen]

    async def one(key: str) -> None:
        async with sem:
            try:
                data = await store.get(key)
            except NotFound:
                return
        ids.update(parse_stored(GcTouched.parse, data, key).ids)
        seen.add(key)

    await asyncio.gather(*(one(k) for k in keys))
