"""The census: bytes per job and per step, kept up to date by what changes them
(commits, retention, garbage collection) instead of recounted from every manifest
(docs/design/020-census.md).

One task runs it, never twice at once. Its work, in this order of preference:
count the steps committed or forgotten through this server (hooks); a full pass
every ``interval`` (list the jobs' steps, count the committed ones it has not
counted, drop those gone: the steps other replicas and tools commit or forget);
a listing of ``chunks/``, a fan-out directory at a time, every ``list_interval``.
Counting is the worker's (``ckptd.lifecycle.space_book``): a process of its own by
default, niced, that reads and parses the manifests itself, so a server's event
loop and its document thread never parse one for the census; after each piece of
work the census waits so that the worker uses at most ``cpu_share`` of a core.
Large steps' counts are kept in the store as space summaries, so a restarted
server counts them again from one small document each (a rebuild resumes where
the last one stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import CkptdError, NotFound, StoreError
from ckptd.format import check_job, check_step, commit_key, manifest_key
from ckptd.lifecycle.book_views import SUMMARY_MIN_BYTES, Begun, BookError, BookView
from ckptd.lifecycle.capacity import JobSpace, StepSpace, StoreSpace, disk_space
from ckptd.lifecycle.census_worker import Worker, WorkerLost
from ckptd.lifecycle.gc import _CHUNK_KEY
from ckptd.repository import Repository

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (job, step)

SPACE_PREFIX = "space/"


def space_key(job: str, step: int) -> str:
    """Where a step's space summary lies (docs/FORMAT.md, "Space summaries")."""
    return f"{SPACE_PREFIX}{check_job(job)}/{check_step(step)}.json"


# Ranks whose manifests one call to the worker counts: at most this many, and
# about this many bytes (the bytes cross a pipe when the store is not local).
RANK_BATCH = 256
RANK_BATCH_BYTES = 16 << 20
# Counted steps whose commit record a full pass reads again (a step forgotten and
# committed anew under the same number by another server), round robin.
RECHECK_PER_PASS = 32
# Rank manifests read at once from a store that is not local.
READ_AHEAD = 8
# A view is computed again at most this often while a long pass counts.
VIEW_EVERY = 1.0
# A listing of chunks/ works this long at a time, then lets other work in.
LIST_SLICE = 0.5
_FAN_OUT = re.compile(r"[0-9a-f]{2}")


@dataclass(slots=True)
class _Listing:
    """A listing of chunks/ under way: its fan-out directories, the next one to
    list, the sums so far."""

    started_at: float
    prefixes: list[str]
    next: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    ids: array[int] = field(default_factory=lambda: array("Q"))  # each id's first 8 bytes


class Census:
    """Space accounting of one repository (see the module's docstring)."""

    def __init__(
        self,
        repo: Repository,
        *,
        interval: float = 60.0,
        list_interval: float = 600.0,
        cpu_share: float = 0.5,
        process: bool = True,
        persist: bool = True,
        fresh_after: float = 5.0,
    ) -> None:
        self.repo = repo
        self.store = repo.store
        self.interval = interval  # full passes (0: only when asked)
        self.list_interval = list_interval
        self.cpu_share = min(1.0, max(0.01, cpu_share))
        self.persist = persist  # write space summaries (a server; not the read-only CLI)
        self.fresh_after = fresh_after
        self._worker = Worker(process=process)
        self._counted: dict[Key, str] = {}  # -> digest of the commit record counted
        self._problems: dict[Key, list[str]] = {}  # damaged documents, each named
        self._unreadable: set[Key] = set()  # committed steps whose record did not count
        self._found: set[Key] = set()  # committed steps the last full pass found
        self._queue: dict[Key, None] = {}  # committed through this server: to count
        self._drops: set[Key] = set()  # forgotten through this server
        self._full_at: float | None = None  # monotonic end of the last full pass
        self._full_running = False
        self._want_full = False
        self._recheck_at = 0
        self._listing: _Listing | None = None
        self._listed: tuple[int, int, float] | None = None  # chunks, bytes, listed at
        self._collected: tuple[int, int, float] | None = None  # a collection's, to take in
        self._list_due = 0.0  # monotonic
        # When (wall clock) a step went before it was counted: its chunks are in the
        # store and in no count, so the chunk totals wait for a listing begun since.
        self._relist_since: float | None = None
        self._view: BookView | None = None
        self._view_dirty = True
        self._view_at = 0.0
        self._view_taken = time.time()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._running = False
        self._lock = asyncio.Lock()  # one piece of work at a time: the book is one

    # -- what others tell it --------------------------------------------------------

    def note_commit(self, job: str, step: int) -> None:
        """A step committed through this server (the repository's hook)."""
        self._queue[(job, step)] = None
        self._poke()

    def note_forgotten(self, job: str, steps: list[int]) -> None:
        """Retention forgot these steps through this server."""
        self._drops.update((job, s) for s in steps)
        self._poke()

    def note_collection(self, chunks: int, chunk_bytes: int, listed_at: float) -> None:
        """A garbage collection listed ``chunks/`` at ``listed_at`` and left this
        many chunks and bytes: the chunk totals, without a listing of our own."""
        self._collected = (chunks, chunk_bytes, listed_at)
        self._poke()

    def _poke(self) -> None:
        self._idle.clear()
        self._wake.set()

    # -- what others ask of it ------------------------------------------------------

    @property
    def space(self) -> StoreSpace | None:
        """The last view, without waiting (metrics); None before the first."""
        return self._make_space() if self._view is not None else None

    async def current(self, wait: float) -> StoreSpace:
        """The view, after a pass that began after this call if one ends within
        ``wait`` seconds, else as it stands (``complete`` says whether it is whole).
        With no census task running, counts everything first (the CLI)."""
        if not self._running:
            return await self.count_all()
        stale = self._full_at is None or time.monotonic() - self._full_at > self.fresh_after
        if stale and not self._full_running:
            self._want_full = True
        self._poke()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._idle.wait()
        return self.space or self._make_space()

    async def count_all(self) -> StoreSpace:
        """One full pass and a whole listing, now (no throttle); after the piece of
        work the task may be doing (one at a time, whoever asks)."""
        async with self._lock:
            await self._full_pass()
            await self._begin_listing()
            while self._listing is not None:
                await self._list_some(throttle=False, slice_s=None)
            await self._refresh_view()
        return self.space or self._make_space()

    def start(self) -> asyncio.Task[None]:
        """Starts the census task (``run``); until it ends, ``current`` waits for
        it rather than counting by itself."""
        self._running = True
        return asyncio.create_task(self.run())

    # -- the task ---------------------------------------------------------------------

    async def run(self) -> None:
        """The census task: its work one piece at a time, then waits for more."""
        self._running = True  # (``start`` says so before the task first runs)
        try:
            while True:
                try:
                    await self._work_once()
                except WorkerLost as exc:
                    log.warning("census: %s", exc)
                    self._forget_book()
                except (CkptdError, BookError, OSError) as exc:
                    log.warning("census failed: [%s] %s; trying again",
                                getattr(exc, "code", type(exc).__name__), exc)
                    await self._pause()
                except Exception:  # a bug: said, and the census goes on (it is no one's to see)
                    log.exception("census failed; trying again")
                    await self._pause()
        finally:
            self._running = False
            self._idle.set()

    async def _work_once(self) -> None:
        # Every request is kept as state (the queue, the drops, a full pass wanted);
        # the wake only ends the wait. Cleared before it looks, so a poke that comes
        # while it looks (a commit during the view's refresh) is seen below.
        self._wake.clear()
        async with self._lock:
            if await self._work_piece():
                return
            await self._refresh_view()
        if self._wake.is_set():
            return  # poked while it looked: look again before it says it is idle
        self._idle.set()
        now = time.monotonic()
        due = [self._list_due]
        if self.interval > 0 and self._full_at is not None:
            due.append(self._full_at + self.interval)
        # asyncio.timeout, not wait_for: on 3.11, wait_for returns when the event
        # is set in the loop's turn that cancels it, and the cancel is lost (the
        # server's stop then waits for the next listing).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.01, min(due) - now)):
                await self._wake.wait()

    async def _work_piece(self) -> bool:
        """Does the most pressing piece of work; False when there is none."""
        now = time.monotonic()
        if self._collected is not None:
            collected, self._collected = self._collected, None
            await self._call("listed", None)
            self._listed, self._listing = collected, None
            self._took_in_listing(collected[2])
        elif self._drops or self._queue:
            await self._count_queued()
        elif self._want_full or self._full_at is None or (
                self.interval > 0 and now - self._full_at >= self.interval):
            await self._full_pass()
        elif self._listing is not None or self._listed is None or now >= self._list_due:
            if self._listing is None:
                await self._begin_listing()
            await self._list_some(throttle=True, slice_s=LIST_SLICE)
        else:
            return False
        return True

    def _took_in_listing(self, started_at: float) -> None:
        if self._relist_since is not None and started_at >= self._relist_since:
            self._relist_since = None
        # (one begun before a step went uncounted may lack its chunks: again, now)
        self._list_due = 0.0 if self._relist_since is not None \
            else time.monotonic() + self.list_interval
        self._view_dirty = True

    async def _pause(self) -> None:
        self._idle.set()  # (a request waiting for the view gets it as it stands)
        await asyncio.sleep(min(5.0, self.interval or 5.0))

    def _forget_book(self) -> None:
        """The worker's book is gone: count everything again, list chunks/ again."""
        self._counted.clear()
        self._problems.clear()
        self._unreadable.clear()
        self._listing = self._listed = self._relist_since = None
        self._want_full = True

    async def close(self) -> None:
        await self._worker.close()

    # -- counting ---------------------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        result, cpu = await self._worker.call(method, *args)
        if cpu > 0 and self.cpu_share < 1.0:  # the worker's share of a core, at most
            await asyncio.sleep(min(30.0, cpu * (1.0 / self.cpu_share - 1.0)))
        return result

    async def _count_queued(self) -> None:
        drops, self._drops = self._drops, set()
        counted = set(self._counted)
        await self._drop(drops)
        while self._queue:
            key = next(iter(self._queue))
            # Left in the queue until counted: a view taken meanwhile must not say
            # it is complete without this step.
            if await self._count(*key):
                self._found.add(key)
            elif key not in counted:  # committed, then forgotten before it was counted
                self._lost_sight()
            self._queue.pop(key, None)
            await self._refresh_view(every=VIEW_EVERY)

    async def _drop(self, keys: set[Key]) -> None:
        if not keys:
            return
        await self._call("drop", sorted(keys))
        for key in keys:
            self._counted.pop(key, None)
            self._problems.pop(key, None)
            self._unreadable.discard(key)
            self._found.discard(key)
        self._view_dirty = True

    async def _full_pass(self) -> None:
        """Finds the committed steps; counts those not counted, drops those gone,
        reads a few counted ones' records again, and deletes summaries of steps that
        are gone."""
        self._want_full = False
        self._full_running = True
        try:
            # Summaries are listed before the steps: one listed here whose step the
            # listing below does not find was written before that step went.
            summaries = [k async for k in self.store.list_prefix(SPACE_PREFIX)] \
                if self.persist else []
            found: set[Key] = set()
            for job in await self.repo.list_jobs():
                steps = await self.repo.step_numbers(job)
                present = await self.store.exists_many([commit_key(job, s) for s in steps])
                found.update((job, s) for s, ok in zip(steps, present, strict=True) if ok)
            if self._found - found - set(self._counted) - self._unreadable:
                self._lost_sight()  # found by the last pass, gone before it was counted
            await self._drop({k for k in self._counted if k not in found}
                             | {k for k in self._unreadable | set(self._problems)
                                if k not in found})
            self._found = found
            for key in sorted(found - set(self._counted)):
                if not await self._count(*key):
                    self._lost_sight()
                await self._refresh_view(every=VIEW_EVERY)
            counted = sorted(self._counted)
            for i in range(min(RECHECK_PER_PASS, len(counted))):
                await self._count(*counted[(self._recheck_at + i) % len(counted)])
            self._recheck_at += RECHECK_PER_PASS
            await self._delete_orphans(summaries, found)
            self._view_dirty = True
        finally:
            self._full_running = False
        self._full_at = time.monotonic()

    async def _count(self, job: str, step: int) -> bool:
        """Counts one committed step (again only if its record changed); False when
        it is not committed (any more)."""
        key, ckey = (job, step), commit_key(job, step)
        try:
            record = await self.store.get(ckey)
        except NotFound:
            if key in self._counted or key in self._problems:
                await self._drop({key})
            return False
        try:
            begun: Begun = await self._call("begin", job, step, record, ckey)
        except BookError as exc:
            await self._drop({key})
            self._problems[key] = [str(exc)]
            self._unreadable.add(key)
            return True
        if self._counted.get(key) == begun.digest:
            await self._call("abort", job, step)
            return True
        try:
            problems, summary = await self._count_ranks(job, step, begun)
        except BaseException:
            with contextlib.suppress(CkptdError, BookError):
                await self._worker.call("abort", job, step)
            raise
        self._counted[key] = begun.digest
        self._unreadable.discard(key)
        if problems and not await self.store.exists(ckey):
            # Forgotten while its manifests were read (the record goes first): not
            # a damaged step, a step gone.
            await self._drop({key})
            return False
        if problems:
            self._problems[key] = problems
        else:
            self._problems.pop(key, None)
        self._view_dirty = True
        if summary is not None:
            await self._keep_summary(job, step, *summary)
        return True

    async def _count_ranks(self, job: str, step: int, begun: Begun
                           ) -> tuple[list[str], tuple[bytes, bytes | None] | None]:
        """Loads the step's summary, or counts its manifests; (problems, (summary
        to keep, the bytes it replaces) or None)."""
        big = begun.manifest_bytes >= SUMMARY_MIN_BYTES
        old: bytes | None = None
        if big:
            with contextlib.suppress(NotFound):
                old = await self.store.get(space_key(job, step))
            if old is not None:
                unusable = await self._call("load", job, step, old)
                if unusable is None:
                    return [], None
                problem, replace = unusable
                log.info("census: the space summary %s is not used (%s); counting the "
                         "step's manifests", space_key(job, step), problem)
                if not replace:  # a newer ckptd's: left as it is
                    big = False
        problems: list[str] = []
        batch: list[tuple[int, bytes | None, str | None, str]] = []
        size = 0
        # (large manifests one at a time: at most one is held here)
        ahead = READ_AHEAD if begun.manifest_bytes <= RANK_BATCH_BYTES * begun.world_size \
            / READ_AHEAD else 1
        for start in range(0, begun.world_size, ahead):
            ranks = range(start, min(start + ahead, begun.world_size))
            keys = [manifest_key(job, step, rank) for rank in ranks]
            paths = [self.store.local_path(k) for k in keys]
            # The worker reads a local store's files itself; others' are read here,
            # a few at once (a thousand ranks one after the other is a minute on S3).
            datas = await asyncio.gather(*(self._get_or_none(k) if p is None else _none()
                                           for k, p in zip(keys, paths, strict=True)))
            for rank, key, path, data in zip(ranks, keys, paths, datas, strict=True):
                batch.append((rank, data, str(path) if path is not None else None, key))
                size += len(data) if data is not None else 0
                if len(batch) >= RANK_BATCH or size >= RANK_BATCH_BYTES:
                    problems += await self._call("add_ranks", job, step, batch)
                    batch, size = [], 0
        if batch:
            problems += await self._call("add_ranks", job, step, batch)
        doc: bytes | None = await self._call("finish", job, step, big and self.persist)
        return problems, (doc, old) if doc is not None else None

    def _lost_sight(self) -> None:
        """A step went before it was counted: the chunks it named are in the store
        (until a collection) and in no count; a listing begun from now finds them."""
        if self._relist_since is None:
            self._relist_since = time.time()
        self._list_due = 0.0
        self._view_dirty = True

    async def _get_or_none(self, key: str) -> bytes | None:
        try:
            return await self.store.get(key)
        except NotFound:
            return None

    async def _keep_summary(self, job: str, step: int, doc: bytes, old: bytes | None) -> None:
        """Puts a step's space summary: created if absent, else replacing the stale
        or damaged one read (compare-and-swap: never what another writer just put)."""
        key = space_key(job, step)
        try:
            if old is None and await self.store.put_if_absent(key, doc):
                return
            if old is None:
                old = await self.store.get(key)
            if old != doc:
                await self.store.compare_and_swap(key, old, doc)
        except (StoreError, NotFound) as exc:  # a hint: counting goes on without it
            log.warning("census: could not keep the space summary %s: %s", key, exc)

    async def _delete_orphans(self, summaries: list[str], found: set[Key]) -> None:
        for key in summaries:
            parts = key[len(SPACE_PREFIX):].removesuffix(".json").split("/")
            if len(parts) != 2 or not parts[1].isdigit():
                continue
            job, step = parts[0], int(parts[1])
            if (job, step) in found:
                continue
            try:
                if not await self.store.exists(commit_key(job, step)):
                    await self.store.delete(key)
            except (CkptdError, StoreError) as exc:
                log.warning("census: could not delete %s: %s", key, exc)

    # -- chunks/ ------------------------------------------------------------------------

    async def _begin_listing(self) -> None:
        # Only the fan-out directories there are (one request on S3): a small store
        # is listed in a few requests, not 256.
        started = time.time()
        await self._call("listing")
        names = await self.store.list_dir("chunks/")
        self._listing = _Listing(started, [n for n in names if _FAN_OUT.fullmatch(n)])

    async def _list_some(self, *, throttle: bool, slice_s: float | None) -> None:
        """Lists fan-out directories of ``chunks/`` for about ``slice_s`` seconds."""
        listing = self._listing
        assert listing is not None
        t_end = None if slice_s is None else time.monotonic() + slice_s
        while listing.next < len(listing.prefixes) and (
                t_end is None or time.monotonic() < t_end):
            t0 = time.monotonic()
            async for info in self.store.list_info(f"chunks/{listing.prefixes[listing.next]}/"):
                if m := _CHUNK_KEY.match(info.key):
                    listing.chunks += 1
                    listing.chunk_bytes += info.size
                    listing.ids.append(int(m.group(2)[:16], 16))
            listing.next += 1
            if throttle and self.cpu_share < 1.0:
                await asyncio.sleep(min(5.0, (time.monotonic() - t0)
                                        * (1.0 / self.cpu_share - 1.0)))
            if self._listing is not listing:  # a collection's totals came meanwhile
                return
        if listing.next >= len(listing.prefixes):
            if sys.byteorder == "little":
                listing.ids.byteswap()  # (to the summaries' order of bytes)
            await self._call("listed", listing.ids.tobytes())
            self._listed = (listing.chunks, listing.chunk_bytes, listing.started_at)
            self._listing = None
            self._took_in_listing(listing.started_at)

    # -- the view -----------------------------------------------------------------------

    async def _refresh_view(self, every: float = 0.0) -> None:
        if not self._view_dirty and self._view is not None:
            return
        if every and time.monotonic() - self._view_at < every:
            return
        # Clean only once the new view is here: until then ``space`` gives the last
        # one, which lacks what made it dirty. (Nothing changes the book meanwhile:
        # it is changed under the lock this runs under.)
        self._view = await self._call("view")
        self._view_dirty = False
        self._view_at = time.monotonic()
        self._view_taken = time.time()

    def _make_space(self) -> StoreSpace:
        view = self._view or BookView((), 0, 0, 0)
        # As listed, plus what steps counted since name that no step named then
        # (before any listing: what the counted steps name).
        chunks, chunk_bytes, listed_at = self._listed or (0, 0, None)
        chunks, chunk_bytes = chunks + view.new_chunks, chunk_bytes + view.new_bytes
        uncounted = len(self._found - set(self._counted) - self._unreadable) + len(self._queue)
        space = StoreSpace(
            chunk_bytes=chunk_bytes, chunks=chunks, chunks_listed_at=listed_at,
            taken_at=self._view_taken,
            jobs=[JobSpace(j.job, j.stored_bytes, j.logical_bytes,
                           [StepSpace(*s) for s in j.steps]) for j in view.jobs],
            referenced_bytes=view.referenced_bytes, referenced_chunks=view.referenced_chunks,
            # (every chunk a counted step names is in the totals: listed, or new)
            unreferenced_chunks=max(0, chunks - view.referenced_chunks),
            unreferenced_bytes=max(0, chunk_bytes - view.referenced_bytes),
            damaged=[p for key in sorted(self._problems) for p in self._problems[key]],
            uncounted_steps=uncounted,
            listing_again=self._relist_since is not None,
            complete=(self._full_at is not None and uncounted == 0
                      and listed_at is not None and self._relist_since is None
                      and not self._view_dirty),
        )
        disk = disk_space(self.store)
        if disk is not None:
            space.free_bytes, space.total_bytes = disk
        return space


async def census(repo: Repository) -> StoreSpace:
    """Counts the whole store once, in this process (``ckptd space`` on a store)."""
    counter = Census(repo, process=False, persist=False)
    try:
        return await counter.count_all()
    finally:
        await counter.close()


async def _none() -> None:
    return None
