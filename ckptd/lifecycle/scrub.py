"""Scrub: re-hash chunks at rest, oldest-verified first, within an I/O budget.

A rolling cursor (``gc/scrub``) remembers the last chunk id verified; each run
resumes after it and wraps around, so the chunk verified longest ago is always
next. A corrupt chunk is repaired from any source (a replica store, a live peer)
whose copy hashes to the id, by compare-and-swap against the corrupt bytes. One
that cannot be repaired marks every committed step that names it damaged
(``jobs/<job>/damage/<step>.json``); restore of ``latest`` then skips those steps.
A marked chunk found good later (repaired, or put back by hand) leaves the marker
in the same compare-and-swap that adds the step's new damage; the marker goes with
its last chunk, and the step is whole."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.documents import parse_stored
from ckptd.errors import (
    CkptdError,
    InvalidDocument,
    InvalidRequest,
    NotFound,
    StoreCorrupt,
    UnsupportedStoredFormat,
)
from ckptd.format import MAX_STEP, chunk_key, commit_key
from ckptd.hashing import chunk_id
from ckptd.lifecycle.capacity import committed_steps
from ckptd.lifecycle.documents import SCRUB_KEY, Damage, ScrubCursor, damage_key, damage_prefix
from ckptd.repository import Repository
from ckptd.store import open_store
from ckptd.store.base import Store

log = logging.getLogger(__name__)

#: a place that may hold a good copy of a chunk: its bytes, or None
ChunkSource = Callable[[str], Awaitable[bytes | None]]
_CHUNK_KEY = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})$")
# How often a long run stores its cursor (and marks the damage it found), and how
# long a stopped one may take to do so: a restart loses at most that much of a pass.
KEEP_EVERY_S = 30.0
KEEP_ON_STOP_S = 10.0


@dataclass(slots=True)
class ScrubReport:
    chunks_checked: int = 0
    bytes_checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    # Those of ``corrupt`` whose object does not read at all (a link that loops, a
    # FIFO, a read error): verify's word for them is "unreadable"
    unreadable: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    damaged: dict[str, list[int]] = field(default_factory=dict)  # job -> steps marked
    # job -> steps whose marker this run removed: every chunk it named reads good now
    whole_again: dict[str, list[int]] = field(default_factory=dict)
    # Other damaged documents met, each named and what became of it: scrub's own
    # cursor or a damage marker (replaced), a commit record that does not read
    # (its step could not be checked for the corrupt chunks).
    damaged_documents: list[str] = field(default_factory=list)
    passes_completed: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class ScrubProgress:
    """How far a scrub is while it runs (a server's ``GET /v1/scrub`` shows it)."""

    chunks_total: int | None = None  # the chunks listed (a whole pass checks each), once listed
    chunks_checked: int = 0
    bytes_checked: int = 0
    corrupt: int = 0


def replica_store(url: str) -> Store:
    """The replica store ``url`` names (a server's ``CKPTD_SCRUB_REPLICA``), opened
    without creating it; ``InvalidRequest`` saying what is wrong with it: a server,
    ``memory://`` (a new, empty store), a URL no store has, or a directory that is
    not there (scrub repairs from a copy of the store and never makes one)."""
    if url.startswith(("http://", "https://")):
        raise InvalidRequest(f"{url} is a server: name a copy of the store (a directory, "
                             "file:///path or s3://bucket/prefix); a server's scrub also "
                             "repairs from its ranks' peers")
    if url.startswith("memory://"):
        raise InvalidRequest("memory:// is a new, empty store: name a copy of the store (a "
                             "directory, file:///path or s3://bucket/prefix)")
    try:
        return open_store(url, create=False)
    except NotFound as exc:  # (a directory not there: a mistyped path)
        path = Path(str(exc.detail.get("path", url)))
        what = "a file" if path.exists() else "no such directory"
        raise InvalidRequest(f"no store at {path} ({what}); name a copy of the store to "
                             "repair from (scrub never creates one)") from None


def store_source(store: Store) -> ChunkSource:
    """A replica store as a repair source."""

    async def get(cid: str) -> bytes | None:
        try:
            return await store.get(chunk_key(cid))
        except NotFound:
            return None

    return get


async def _cursor(store: Store, report: ScrubReport) -> tuple[ScrubCursor, bytes | None]:
    try:
        data = await store.get(SCRUB_KEY)
    except NotFound:
        return ScrubCursor(after="", pass_started_at=time.time(), passes=0), None
    try:
        # A cursor of a newer format is a newer ckptd's, not damage: as gc/state, it
        # is left alone, and this ckptd does not scrub (UnsupportedStoredFormat).
        return parse_stored(ScrubCursor.parse, data, SCRUB_KEY), data
    except StoreCorrupt as exc:
        log.warning("scrub cursor %s does not parse; starting a new pass", SCRUB_KEY)
        report.damaged_documents.append(f"{exc.message}; replaced (a new pass started)")
        return ScrubCursor(after="", pass_started_at=time.time(), passes=0), data


async def scrub(
    repo: Repository,
    *,
    budget_bytes: int | None = None,
    rate_bytes_per_s: float | None = None,
    sources: Sequence[ChunkSource] = (),
    clock: Callable[[], float] = time.time,
    progress: ScrubProgress | None = None,
) -> ScrubReport:
    """Verifies stored chunks from the cursor on, until ``budget_bytes`` were read
    (None: one whole pass), at most ``rate_bytes_per_s``; repairs or marks damage.
    ``progress``, when given, is kept up to date as it goes."""
    if budget_bytes is not None and budget_bytes < 0:
        raise InvalidRequest(f"budget must be >= 0 bytes, not {budget_bytes}")
    store = repo.store
    t0 = time.perf_counter()
    report = ScrubReport()
    cursor, cursor_bytes = await _cursor(store, report)
    ids = [m.group(2) async for k in store.list_prefix("chunks/")
           if (m := _CHUNK_KEY.match(k))]
    ids.sort()
    progress = progress if progress is not None else ScrubProgress()
    progress.chunks_total = len(ids)
    # Resume after the cursor; the rest of the ring follows (a new pass).
    start = next((i for i, c in enumerate(ids) if c > cursor.after), len(ids))
    order = ids[start:] + ids[:start]
    after, passes, pass_started = cursor.after, cursor.passes, cursor.pass_started_at
    unrepaired: dict[str, float] = {}  # id -> when it was read bad
    # The chunks markers name, and when this run found each of them good (a good
    # read, or a repair): keep() takes them out of the markers.
    unread: list[str] = []
    marked = {cid async for _, _, doc in damage_markers(repo, unread) for cid in doc.chunks}
    report.damaged_documents.extend(unread)
    healed: dict[str, float] = {}
    ours = True  # the stored cursor is this run's to move (not another scrubber's)

    async def keep() -> None:
        """Marks the damage found so far and takes the chunks found good out of the
        markers (one compare-and-swap per marker for both: a step is never shown
        whole, nor its marker gone, while a chunk of it is known bad), then stores
        how far this run got: a run stopped midway (a server restarting) loses
        neither, and the next resumes. In that order: a cursor never passes a
        corrupt chunk whose steps are unmarked."""
        nonlocal cursor_bytes, ours, unrepaired, healed
        if unrepaired or healed:
            settled = await settle_damage(repo, unrepaired, healed, report.damaged_documents)
            # The report says where each step stands after this keep (an earlier keep
            # of this run may have said otherwise).
            for job, steps in settled.damaged.items():
                report.damaged[job] = sorted({*report.damaged.get(job, ()), *steps})
                _drop(report.whole_again, job, steps)
            for job, steps in settled.whole.items():
                report.whole_again[job] = sorted({*report.whole_again.get(job, ()), *steps})
                _drop(report.damaged, job, steps)
            unrepaired, healed = {}, {}  # (settled: a failure above keeps them for the next)
        if ours:
            new = ScrubCursor(after=after, pass_started_at=pass_started,
                              passes=passes).canonical()
            # Lost to another scrubber's update: its cursor is as good as ours.
            ours = await store.compare_and_swap(SCRUB_KEY, cursor_bytes, new)
            cursor_bytes = new

    def found(cid: str, good: bool, read_at: float) -> None:
        """Notes a chunk's read for keep(): a good one at when the read began, a bad
        one at when it ended (the order of a good and a bad read is never guessed in
        favour of the good one). A run that wraps reads a chunk twice: the last says."""
        if good:
            unrepaired.pop(cid, None)
            healed[cid] = read_at
        else:
            healed.pop(cid, None)
            unrepaired[cid] = clock()
            marked.add(cid)

    kept_at = time.monotonic()
    try:
        for cid in order:
            if budget_bytes is not None and report.bytes_checked >= budget_bytes:
                break
            if time.monotonic() - kept_at >= KEEP_EVERY_S:
                try:
                    await keep()
                except (CkptdError, OSError) as exc:  # (a store's hiccup: the pass goes on)
                    log.warning("scrub: keeping how far it got failed (tried again in %.0f "
                                "s): %s", KEEP_EVERY_S, exc)
                kept_at = time.monotonic()
            read_at = clock()
            try:
                data: bytes | None = await store.get(chunk_key(cid))
            except NotFound:
                continue  # collected since it was listed
            except StoreCorrupt as exc:  # there, but does not read (a link loop, a read error)
                log.warning("scrub: %s", exc)
                data = None
                report.unreadable.append(cid)
            report.chunks_checked += 1
            report.bytes_checked += len(data) if data is not None else 0
            if data is None or await asyncio.to_thread(chunk_id, data) != cid:
                report.corrupt.append(cid)
                if await repair_chunk(store, cid, data, sources):
                    report.repaired.append(cid)
                    found(cid, True, read_at)  # (marked by another scrub meanwhile, maybe)
                else:
                    found(cid, False, read_at)
            elif cid in marked:
                found(cid, True, read_at)
            progress.chunks_checked, progress.bytes_checked = (report.chunks_checked,
                                                               report.bytes_checked)
            progress.corrupt = len(report.corrupt)
            if cid <= after:  # wrapped past the end of the ring: a pass ended
                passes += 1
                report.passes_completed += 1
                pass_started = clock()
            after = cid
            if rate_bytes_per_s:
                ahead = report.bytes_checked / rate_bytes_per_s - (time.perf_counter() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    except BaseException:  # cancelled (a server stopping) or failed: keep what it did
        try:
            async with asyncio.timeout(KEEP_ON_STOP_S):
                await keep()
        except Exception as exc:  # (the error that stopped the run is the one said)
            log.warning("scrub: stopped, and keeping how far it got failed: %s", exc)
        raise
    await keep()
    report.seconds = time.perf_counter() - t0
    log.info("scrub: %d chunks (%d bytes), %d corrupt, %d repaired, damaged %s, whole "
             "again %s", report.chunks_checked, report.bytes_checked, len(report.corrupt),
             len(report.repaired), report.damaged, report.whole_again)
    return report


async def repair_chunk(store: Store, cid: str, bad: bytes | None,
                  sources: Sequence[ChunkSource]) -> bool:
    """Replaces a corrupt chunk (``bad``: its bytes, None when its object does not
    read) with a copy from ``sources`` that hashes to its id."""
    for source in sources:
        try:
            good = await source(cid)
        except (CkptdError, OSError) as exc:
            log.info("scrub: repair source failed for %s: %s", cid, exc)
            continue
        if good is None or await asyncio.to_thread(chunk_id, good) != cid:
            continue  # the hash proves a copy; anything else is not one
        if bad is None:  # nothing to compare: the entry goes, the copy takes its name
            await store.delete(chunk_key(cid))
            if await store.put_if_absent(chunk_key(cid), good):
                log.warning("scrub: repaired unreadable chunk %s", cid)
                return True
        elif await store.compare_and_swap(chunk_key(cid), bad, good):
            log.warning("scrub: repaired corrupt chunk %s", cid)
            return True
        try:  # changed under us: good if it is good now
            return await asyncio.to_thread(chunk_id, await store.get(chunk_key(cid))) == cid
        except (NotFound, StoreCorrupt):
            return False
    log.error("scrub: chunk %s is corrupt and no source holds a good copy", cid)
    return False


@dataclass(slots=True)
class Settled:
    """What ``settle_damage`` did: job -> steps marked damaged (a marker names them),
    and job -> steps whose marker went with its last chunk (whole again)."""

    damaged: dict[str, list[int]] = field(default_factory=dict)
    whole: dict[str, list[int]] = field(default_factory=dict)


async def settle_damage(repo: Repository, bad: dict[str, float], good: dict[str, float],
                        documents: list[str] | None = None) -> Settled:
    """Marks every committed step naming a chunk of ``bad`` (id -> when it was read
    bad) damaged, and takes the chunks of ``good`` (id -> when it was read good) out of
    the markers naming them: one compare-and-swap per marker for both, so no step
    is shown whole, nor its marker gone, while a chunk of it is known bad. The
    damaged documents met on the way are named in ``documents``, when given."""
    hits: dict[tuple[str, int], set[str]] = {}
    unread: list[str] = []
    if bad:
        async for job, step, _, ids in committed_steps(repo, unread):
            if hit := ids & bad.keys():
                hits[(job, step)] = hit
    if good:
        async for job, step, doc in damage_markers(repo):
            if good.keys() & set(doc.chunks):
                hits.setdefault((job, step), set())
    settled = Settled()
    for (job, step), hit in sorted(hits.items()):
        if await _settle_marker(repo.store, job, step, {c: bad[c] for c in hit}, good,
                                documents):
            settled.whole.setdefault(job, []).append(step)
        elif hit:
            settled.damaged.setdefault(job, []).append(step)
    if documents is not None:  # (once each, however often a run marks)
        said = [f"{why} (its step not checked for the corrupt chunks)" for why in unread]
        documents.extend(line for line in dict.fromkeys(said) if line not in documents)
    return settled


async def _settle_marker(store: Store, job: str, step: int, bad: dict[str, float],
                         good: dict[str, float], documents: list[str] | None) -> bool:
    """Rewrites the step's marker to name (its chunks less those of ``good`` read
    good after its ``found_at``) plus ``bad``, by compare-and-swap against the bytes
    read: a chunk another scrub marks meanwhile is never dropped unseen. Deletes it
    when none is left (True). With ``bad``, ``found_at`` moves on to the latest bad
    read, also of a chunk listed already (corrupt again after a repair): a good read
    older than a chunk's latest bad one never drops it. A chunk read good before the
    marker's ``found_at`` stays, until a later good read.

    The times come from the clocks of the scrubs that read (a server's, a ``ckptd
    scrub``'s host): reads on different hosts closer together than their clocks'
    skew may be taken in the wrong order, and a chunk read bad after a good read
    dropped. It is still corrupt: the next pass that reads it marks it again."""
    key = damage_key(job, step)
    for _ in range(100):
        try:
            current: bytes | None = await store.get(key)
        except NotFound:
            current = None
        known: list[str] = []
        found_at = float("-inf")
        try:
            if current is not None:
                doc = parse_stored(Damage.parse, current, key)
                known, found_at = doc.chunks, doc.found_at
        except UnsupportedStoredFormat as exc:  # a newer ckptd's: its step stays marked
            if documents is not None and (said := _left_newer(exc)) not in documents:
                documents.append(said)
            return False
        except StoreCorrupt as exc:  # what it said is lost; the marker written now repairs it
            if not bad:
                return False  # (replaced when scrub next marks its step)
            log.warning("%s; replacing it", exc.message)
            if documents is not None and f"{exc.message}; replaced" not in documents:
                documents.append(f"{exc.message}; replaced")  # (once, however often tried)
        left = {c for c in known if good.get(c, found_at) <= found_at}
        chunks = sorted(left | bad.keys())
        stamp = max([found_at, *bad.values()])
        if chunks == known and stamp == found_at:
            return False  # (nothing to mark, nothing found good since it was marked)
        if not chunks:
            if current is None:
                return False
            if await store.compare_and_delete(key, current):
                log.warning("scrub: step %d of %s is whole again (its damaged chunks read "
                            "good)", step, job)
                return True
        elif await store.compare_and_swap(key, current, Damage(
                job=job, step=step, chunks=chunks, found_at=stamp).canonical()):
            if bad.keys() - set(known):
                log.error("scrub: step %d of %s is damaged (%d chunks)", step, job,
                          len(chunks))
            if len(left) < len(known):
                log.warning("scrub: step %d of %s: %d of its damaged chunks read good, %d "
                            "still damaged", step, job, len(known) - len(left), len(chunks))
            return False
    return False


async def damage_markers(repo: Repository, unread: list[str] | None = None
                   ) -> AsyncIterator[tuple[str, int, Damage]]:
    """(job, step, parsed) of every damage marker that reads. One that does not is
    named in ``unread``, when given, with what becomes of it: a damaged one is a claim
    of damage that cannot be checked (which chunks it named is lost), so it stays
    until scrub marks its step again (then replaced) or an operator removes it; a
    newer ckptd's is left as it is."""
    for job in await repo.list_jobs():
        for name in await repo.store.list_dir(damage_prefix(job)):
            stem = name.removesuffix(".json")
            if not stem.isdigit() or int(stem) >= MAX_STEP:
                continue
            key = damage_key(job, int(stem))
            try:
                yield job, int(stem), parse_stored(Damage.parse, await repo.store.get(key), key)
            except NotFound:
                continue
            except UnsupportedStoredFormat as exc:
                if unread is not None:
                    unread.append(_left_newer(exc))
            except StoreCorrupt as exc:
                if unread is not None:
                    unread.append(
                        f"{exc.message}; left as it is: restores of latest skip step {stem} "
                        f"while it is there. `ckptd verify {job} {stem}` re-hashes the "
                        "step's chunks: if it finds no bad chunk, delete the marker")


def _left_newer(exc: UnsupportedStoredFormat) -> str:
    return f"{exc.message}; left as it is"


def _drop(steps_of: dict[str, list[int]], job: str, steps: list[int]) -> None:
    """Takes ``steps`` out of a report's job -> steps (a job left none goes)."""
    if kept := [s for s in steps_of.get(job, ()) if s not in steps]:
        steps_of[job] = kept
    else:
        steps_of.pop(job, None)


async def damaged_steps(repo: Repository, job: str) -> dict[int, list[str]]:
    """Step -> its damaged chunk ids, for every marker of ``job`` whose step still
    exists (a forgotten step's marker goes with it)."""
    out: dict[int, list[str]] = {}
    for name in await repo.store.list_dir(f"jobs/{job}/damage/"):
        stem = name.removesuffix(".json")
        if not stem.isdigit():
            continue
        try:
            doc = Damage.parse(await repo.store.get(damage_key(job, int(stem))))
        except (NotFound, InvalidDocument):
            continue
        if await repo.store.exists(commit_key(job, doc.step)):
            out[doc.step] = doc.chunks
    return out
