"""The repository's writes and their order: chunks, rank manifests, the commit
record, then the ``latest`` ref (and an imported step, in that same order).

Reads, rollbacks and timelines, listings and verify are the classes it builds on
(``reads``, ``timelines``, ``listings``, ``verify``); the writes that decide what
exists stay in this one class, so the invariants of DESIGN.md are checked in one
place (and it is a little past the house's ~500 lines for that reason); what
follows a written record (the removal check, the tag, ``latest``) is in
``after_commit``. Rollback's own writes and their order are in ``timelines``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import ckptd.repository as package  # its PRESENCE_BATCH, read at each call
from ckptd import knobs
from ckptd.chunk_claims import ChunkClaims
from ckptd.documents import (
    MANIFEST_CACHE_BYTES,
    MANIFEST_CACHE_ENTRIES,
    ParsedManifests,
    document_work,
)
from ckptd.errors import (
    AlreadyCommitted,
    ChunkHashMismatch,
    Conflict,
    InvalidDocument,
    InvalidRequest,
    ManifestHashMismatch,
    ManifestNotFound,
    MissingChunks,
    NotFound,
    StoreCorrupt,
    StoreError,
    Superseded,
    TooLarge,
    WorldSizeMismatch,
)
from ckptd.format import (
    INCARNATION_META,
    CommitRecord,
    ManifestRef,
    RankManifest,
    canonical_json,
    check_chunk_id,
    check_job,
    check_step,
    chunk_key,
    commit_key,
    manifest_epoch,
    manifest_incarnation,
    manifest_key,
    removal_key,
)
from ckptd.hashing import chunk_id, document_hash
from ckptd.lifecycle import fence as gc_fence
from ckptd.lifecycle.tags import RESERVED_TAGS, TAG_META, check_tag
from ckptd.repository.after_commit import AfterCommit, tag_of
from ckptd.repository.listings import Listings
from ckptd.repository.results import CommitStatus, DamagedView, KnownChunks, MissingResult
from ckptd.repository.verify import Verification
from ckptd.store.base import Store
from ckptd.validation import ReplicaPolicy, validate_step

log = logging.getLogger(__name__)

# Rank manifests a commit reads again at once to see that none was replaced.
REREAD_BATCH = 16



def _check_digest(cid: str, actual: str) -> None:
    if actual != cid:
        raise ChunkHashMismatch(f"chunk body hashes to {actual}, not to its id {cid}", id=cid,
                                actual=actual)

class Repository(Verification, Listings, AfterCommit):
    """Checkpoints of many jobs over one Store, with validation on commit."""

    def __init__(
        self,
        store: Store,
        *,
        replica_mismatch: ReplicaPolicy = "reject",
        clock: Callable[[], float] = time.time,
        manifest_cache_bytes: int = MANIFEST_CACHE_BYTES,
    ) -> None:
        self.store = store
        self.replica_mismatch = replica_mismatch
        self._clock = clock
        self._claims = ChunkClaims()
        # Leases of scoped tenants, apart: another tenant's lease must not show.
        self._tenants: dict[str, ChunkClaims] = {}
        self._tenants_lock = threading.Lock()
        #: called before a missing-chunks call (a snapshot starting): ``StoreFull``
        #: refuses it while the store is nearly full (ckptd.lifecycle.capacity)
        self.space_guard: Callable[[], Awaitable[None]] | None = None
        #: the chunks scrub found corrupt, as saves meet them (lifecycle.damaged_chunks)
        self.damaged: DamagedView | None = None
        self._manifests = ParsedManifests(MANIFEST_CACHE_ENTRIES,
                                          max_bytes=manifest_cache_bytes)

    async def close(self) -> None:
        await self.store.close()

    # -- chunks -----------------------------------------------------------------------

    async def missing_chunks(
        self, ids: list[str], claimer: str | None = None, lease: float | None = None,
        *, tenant: str | None = None, known: KnownChunks | None = None,
    ) -> MissingResult:
        """Which of ``ids`` the store lacks. With a ``claimer``, the ids returned as
        missing are leased to it; ids leased to someone else come back in flight.

        With a ``tenant``, the answer reveals nothing of other tenants: an id counts
        as stored only if ``known`` says the tenant may know of it, and leases are
        the tenant's own (docs/design/006-tenants.md)."""
        if len(ids) > knobs.missing_batch():
            raise TooLarge(f"{len(ids)} ids in one call; at most {knobs.missing_batch()}")
        unique = list(dict.fromkeys(check_chunk_id(cid) for cid in ids))
        if self.space_guard is not None and unique:
            await self.space_guard()
        claims = self._claims if tenant is None else self._tenant_claims(tenant)
        keys = [chunk_key(cid) for cid in unique]

        async def stored() -> list[bool]:
            present = await gc_fence.fenced_presence(
                self.store, unique, lambda: self.store.exists_many(keys))
            if self.damaged is not None:  # (stored, but corrupt: its upload repairs it)
                present = await self.damaged.sound(unique, present)
            if tenant is None or known is None:
                return present
            seen = await known([cid for cid, ok in zip(unique, present, strict=True) if ok])
            return [ok and cid in seen for cid, ok in zip(unique, present, strict=True)]

        if claimer is None:
            present = await stored()
            return MissingResult(
                missing=[cid for cid, ok in zip(unique, present, strict=True) if not ok],
                in_flight=[],
            )
        since = claims.begin()
        try:
            present = await stored()
            absent = [cid for cid, ok in zip(unique, present, strict=True) if not ok]
            mine, theirs = claims.split(absent, claimer, lease or knobs.claim_lease(), since)
        finally:
            claims.end(since)
        return MissingResult(missing=mine, in_flight=theirs)

    def _tenant_claims(self, tenant: str) -> ChunkClaims:
        with self._tenants_lock:
            claims = self._tenants.get(tenant)
            if claims is None:
                claims = self._tenants[tenant] = ChunkClaims()
            return claims

    async def put_chunk(
        self, cid: str, data: bytes | memoryview, *, digest: str | None = None,
        tenant: str | None = None,
    ) -> bool:
        """Stores a chunk after checking that ``data`` hashes to ``cid``.

        ``digest`` is the hash the caller already computed while streaming the body
        in; it is then trusted instead of hashing twice. Without it the bytes are
        hashed where the store writes them (``Store.put_content``'s ``verify``),
        before a byte is written."""
        check_chunk_id(cid)
        stored = False
        try:
            # Whatever happens here, the caller's claim ends: a refused or failed
            # upload must not leave other replicas waiting out the lease.
            if len(data) > knobs.MAX_CHUNK_SIZE:
                raise TooLarge(
                    f"chunk of {len(data)} bytes exceeds {knobs.MAX_CHUNK_SIZE}", id=cid
                )
            if digest is not None:
                _check_digest(cid, digest)
            verified = [digest is not None]

            def verify() -> None:
                if not verified[0]:
                    _check_digest(cid, chunk_id(data))
                    verified[0] = True

            key = chunk_key(cid)
            # A chunk stored already may be garbage a running sweep deletes: kept.
            created = await gc_fence.fenced_put(
                self.store, cid,
                lambda: self.store.put_content(key, data, None if verified[0] else verify))
            if not verified[0]:  # (the conformance suite holds every store to it)
                raise StoreError(f"{self.store.describe()} stored chunk {cid} without "
                                 "running its check (Store.put_content's verify)", key=key)
            stored = True
            if not created and self.damaged is not None:  # (verified: it may repair)
                await self.damaged.uploaded(cid, data)
            return created
        finally:
            claims = self._claims if tenant is None else self._tenant_claims(tenant)
            claims.release(cid, stored=stored)

    # -- manifests ----------------------------------------------------------------------

    def keep_manifests_from_collector(self) -> None:
        """Parsed manifests are built with the cyclic collector paused and frozen
        out of its scans (a server: see ckptd.large_json)."""
        self._manifests.kept_from_collector = True

    async def parse_manifest(self, data: bytes) -> RankManifest:
        """A rank manifest a client sent, parsed and checked off the event loop."""
        return await self._manifests.parse_put(data)

    async def put_manifest(self, manifest: RankManifest | bytes) -> str:
        """Stores a rank manifest once every chunk it names is in the store.

        Manifests are immutable: putting the same one again is a no-op, a different
        one for the same job, step and rank is a ``Conflict``. The one exception is
        a manifest of an ended timeline (saved before a rollback): a manifest of the
        current timeline replaces it. A manifest of an ended timeline is refused
        (``Superseded``)."""
        if isinstance(manifest, bytes | bytearray | memoryview):
            if len(manifest) > knobs.max_manifest_bytes():
                raise TooLarge(f"manifest of {len(manifest)} bytes")
            manifest = RankManifest.parse(bytes(manifest))
        else:
            manifest.check()
        # Encoded and hashed once, off the event loop (24 MiB for 100,000 tensors);
        # a parsed manifest has both already, so not behind the document thread.
        await asyncio.to_thread(manifest.digest)
        data = manifest.canonical()
        key = manifest_key(manifest.job, manifest.step, manifest.rank)
        record = await self._try_read_commit(manifest.job, manifest.step)
        if record is not None:
            # A committed step is closed: only its own manifests may be put again
            # (a retry), no new rank may appear in it.
            digest = manifest.digest()
            if manifest.rank < record.world_size and (
                record.manifests[manifest.rank].hash == digest
            ):
                return digest
            raise await self.refusal_of_committed(manifest, record)
        epoch = manifest_epoch(manifest)
        await self._check_epoch(manifest.job, epoch, f"rank {manifest.rank}'s manifest of step "
                                f"{manifest.step}")
        ids = await asyncio.to_thread(lambda: sorted(manifest.chunk_ids()))
        await gc_fence.wait_not_sweeping(self.store)  # no presence check during a sweep
        lacking = await self._lacking(ids)
        if lacking:
            raise manifest_lacks(manifest.rank, lacking)
        for _ in range(100):
            if await self.store.put_if_absent(key, data):
                self._manifests.put(key, data, manifest)  # commit reads it next
                return manifest.digest()
            try:
                existing = await self.store.get(key)
            except NotFound:
                continue  # deleted in between: try again
            if existing == data:
                self._manifests.put(key, data, manifest)
                return manifest.digest()
            if await self.store.exists(commit_key(manifest.job, manifest.step)):
                raise AlreadyCommitted(
                    f"step {manifest.step} of {manifest.job} is committed; rank "
                    f"{manifest.rank}'s manifest cannot change"
                )
            stored = await self._manifests.parse(key, existing)
            relaunched = manifest_incarnation(stored) != manifest_incarnation(manifest)
            if manifest_epoch(stored) > epoch or (manifest_epoch(stored) == epoch
                                                  and not relaunched):
                raise Conflict(
                    f"rank {manifest.rank} already put a different manifest for step "
                    f"{manifest.step} of {manifest.job}; manifests are immutable, save under "
                    "a new step",
                    job=manifest.job,
                    step=manifest.step,
                    rank=manifest.rank,
                )
            # Saved before a rollback, or by an earlier launch of the job that died
            # before the step committed (a restart re-trains the step, rarely to the
            # same bytes): this one takes its place, and a commit never pairs them.
            if await self.store.compare_and_swap(key, existing, data):
                self._manifests.put(key, data, manifest)
                # A commit that read the manifest replaced here may have written its
                # record since this call looked: the record stands, with its bytes.
                # (Its committer puts them back too, ``_keep_committed``: whichever
                # comes first.)
                try:
                    record = await self._try_read_commit(manifest.job, manifest.step)
                except BaseException:
                    # Not knowing whether a record names the replaced bytes, put them
                    # back: the put fails, a retry replaces them again and looks again.
                    await self.store.compare_and_swap(key, data, existing)
                    raise
                named = (None if record is None or manifest.rank >= record.world_size
                         else record.manifests[manifest.rank].hash)
                if record is not None and named != manifest.digest():
                    if named == document_hash(existing):
                        await self.store.compare_and_swap(key, data, existing)
                    raise AlreadyCommitted(
                        f"step {manifest.step} of {manifest.job} is committed; rank "
                        f"{manifest.rank}'s manifest cannot change", job=manifest.job,
                        step=manifest.step, rank=manifest.rank)
                log.info("%s step %d rank %d: a manifest of timeline %d (launch %r) replaces "
                         "one saved %s", manifest.job, manifest.step, manifest.rank, epoch,
                         manifest_incarnation(manifest),
                         "by another launch" if manifest_epoch(stored) == epoch
                         else "before the rollback")
                return manifest.digest()
        raise Conflict(f"could not put rank {manifest.rank}'s manifest of step {manifest.step} "
                       f"of {manifest.job}: too much contention")

    async def _lacking(self, ids: list[str]) -> list[str]:
        """Which of the chunk ``ids`` the store lacks, asked PRESENCE_BATCH at a time:
        the keys (and a local store's paths) of 100,000 chunks, made in one go, held
        the event loop for a second."""
        lacking: list[str] = []
        size = package.PRESENCE_BATCH  # read where it is set (and tests set it)
        for start in range(0, len(ids), size):
            batch = ids[start:start + size]
            present = await self.store.exists_many([chunk_key(c) for c in batch])
            lacking.extend(cid for cid, ok in zip(batch, present, strict=True) if not ok)
        return lacking

    # -- commit ---------------------------------------------------------------------

    async def commit(
        self, job: str, step: int, *, meta: dict[str, Any] | None = None
    ) -> CommitStatus:
        """Commits a step if all its ranks' manifests are in and agree.

        Idempotent: any rank may call it after putting its manifest; the call that
        finds every rank present validates and writes the commit record, the others
        see ``pending`` (or the record, if it is already there)."""
        check_job(job)
        check_step(step)
        try:
            canonical_json(meta or {})
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"commit meta is not canonical JSON: {exc}") from None
        tag = (meta or {}).get(TAG_META)
        if tag is not None:
            check_tag(tag)  # (refused before the step commits, not after)
            if tag in RESERVED_TAGS:
                # A client from before these names were reserved tags its step so
                # (Lightning's latest.ckpt): the step commits untagged, as one whose
                # tag could not be set; refusing it would lose the step on every retry.
                log.warning("%s step %d: its commit asks for tag %r, a reserved name; "
                            "committed without the tag", job, step, tag)
                tag = None
                meta = {k: v for k, v in (meta or {}).items() if k != TAG_META}
        existing = await self._try_read_commit(job, step)
        if existing is not None:
            # Checked only while retention removes it: an imported step (``restore
            # --to``) holds only the ranks it copied.
            if await self.store.exists(removal_key(job, step)):
                await self._outlast_removal(job, step, existing.world_size, False)
            if tag is not None:  # a retry repairs a tag the first try could not set
                await self._tag_or_say(job, tag, step, existing.world_size)
            moved = await self._advance_latest_or_say(job, existing)
            return CommitStatus("committed", job, step, existing.world_size, [], existing,
                                latest_moved=moved)
        ranks = await self._ranks_present(job, step)
        if not ranks:
            raise ManifestNotFound(f"no rank manifest for step {step} of {job}")
        epoch = await self.epoch(job)
        launch = (meta or {}).get(INCARNATION_META)  # the committing rank's launch
        # One manifest says the world size; the others are read once all are in.
        first = await self._read_manifest_raw(job, step, ranks[0])
        current: dict[int, RankManifest] = {first.rank: first}
        if (epoch or launch is not None) and (
                len(ranks) >= first.world_size or ranks[-1] >= first.world_size
                or manifest_epoch(first) != epoch or manifest_incarnation(first) != launch):
            # Manifests saved before the last rollback count as absent, and so do
            # another launch's when the committer names its own: their ranks put
            # this timeline's (launch's) manifest in their place when they get there
            # (a job that came back smaller leaves ranks past its world size too).
            read = [first, *await asyncio.gather(
                *(self._read_manifest_raw(job, step, r) for r in ranks[1:]))]
            current = {m.rank: m for m in read if manifest_epoch(m) == epoch and (
                launch is None or manifest_incarnation(m) == launch)}
            if not current:
                world = first.world_size
                return CommitStatus("pending", job, step, world, list(range(world)))
            ranks = sorted(current)
            first = current[ranks[0]]
        world = first.world_size
        if ranks[-1] >= world:  # such a rank said another world size: never committable
            raise WorldSizeMismatch(
                f"step {step} of {job} has a manifest of rank {ranks[-1]}, but rank "
                f"{first.rank} says world size {world}",
                ranks=[first.rank, ranks[-1]],
            )
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            return CommitStatus("pending", job, step, world, missing)

        rest = [r for r in ranks if r not in current]
        current.update(zip(rest, await asyncio.gather(
            *(self._read_manifest_raw(job, step, r) for r in rest)), strict=True))
        manifests = [current[r] for r in range(world)]
        if any(manifest_epoch(m) != epoch for m in manifests):
            # A rollback began while this step was being put together.
            raise Superseded(
                f"step {step} of {job} mixes manifests from before and after a rollback; "
                "it cannot commit", job=job, step=step, current=epoch,
            )
        stale = _other_launches(manifests, (meta or {}).get(INCARNATION_META))
        if stale:
            # Some ranks' manifests are an earlier launch's (the job restarted before
            # the step committed): never paired with this launch's. Their ranks put
            # this launch's manifest in their place when they get there.
            log.info("%s step %d: ranks %s hold manifests of another launch; pending until "
                     "they are replaced", job, step, stale)
            return CommitStatus("pending", job, step, world, stale)
        if tag is None:  # any rank may have asked for it, not only the one committing
            tag = tag_of(manifests)
            if tag is not None:
                meta = {**(meta or {}), TAG_META: tag}
        # CPU work that grows with the tensor count: off the event loop.
        report = await document_work(
            validate_step, manifests, replica_mismatch=self.replica_mismatch
        )
        ids = await asyncio.to_thread(
            lambda: sorted({cid for m in manifests for cid in m.chunk_ids()}))
        # The GC fence: chunks found present while no sweep runs stay present, as
        # every later sweep lists these (already stored) manifests after it began.
        gc_state = await gc_fence.wait_not_sweeping(self.store)
        lacking = await self._lacking(ids)
        if lacking:  # a chunk deleted after its manifest went in
            raise MissingChunks(
                f"step {step} references {len(lacking)} chunks the store lacks",
                ids=lacking[:20],
            )
        if self.damaged is not None:
            await self.damaged.check_commit(job, step, ids)
        record = CommitRecord(
            job=job,
            step=step,
            world_size=world,
            manifests=await document_work(
                lambda: [ManifestRef(rank=m.rank, hash=m.digest(), size=len(m.canonical()))
                         for m in manifests]
            ),
            report=report,
            committed_at=self._clock(),
            meta=dict(meta or {}),
        )
        if await self.epoch(job) != epoch:  # a rollback began while we validated
            raise Superseded(
                f"a rollback ended the timeline of step {step} of {job} before it could "
                "commit", job=job, step=step, current=epoch,
            )
        if not await gc_fence.unchanged(self.store, gc_state):  # a sweep began meanwhile
            return await self.commit(job, step, meta=meta)  # look again, after it
        # A newer ckptd's latest ref (UnsupportedFormat): no record written beside it;
        # a damaged one is replaced by this commit's.
        with contextlib.suppress(StoreCorrupt):
            await self._latest_ref(job)
        if await self._replaced(job, step, manifests):
            # A rank of a later launch (or timeline) replaced its manifest while this
            # validated (put_manifest): look again, never name the bytes replaced.
            return await self.commit(job, step, meta=meta)
        won = await self.store.put_if_absent(commit_key(job, step), record.canonical())
        if won:
            await self._keep_committed(job, step, manifests)
        else:
            record = await self.read_commit(job, step)  # a concurrent commit won
        await self._outlast_removal(job, step, world, won)
        if won:
            log.info("committed %s step %d (%d ranks)", job, step, world)
        if tag is not None:  # ckpt.save(..., tag=...): retention keeps the step
            await self._tag_or_say(job, tag, step, world)
        # The record is durable: the step is committed whatever happens to the ref,
        # and the answer says so (a retry of the commit moves the ref).
        moved = await self._advance_latest_or_say(job, record)
        cleared = bool(won and epoch) and await self._end_rollback_or_say(job, step, epoch)
        return CommitStatus("committed", job, step, world, [], record, latest_moved=moved,
                            rollback_cleared=cleared)

    async def _end_rollback_or_say(self, job: str, step: int, epoch: int) -> bool:
        """``end_rollback_passed``; False (logged) when the store failed: the commit
        stands, and the next one past the marker clears it."""
        try:
            return await self.end_rollback_passed(job, step, epoch)
        except StoreError as exc:
            log.warning("%s step %d is committed, but the rollback marker could not be "
                        "cleared: %s", job, step, exc)
            return False

    async def _replaced(self, job: str, step: int, manifests: list[RankManifest]
                        ) -> list[tuple[RankManifest, bytes | None]]:
        """Those of ``manifests`` no longer stored for their rank, each with what is
        (None: nothing); read a few at a time (they can be tens of MiB each)."""
        out: list[tuple[RankManifest, bytes | None]] = []
        for start in range(0, len(manifests), REREAD_BATCH):
            batch = manifests[start:start + REREAD_BATCH]
            stored = await asyncio.gather(
                *(self.store.get(manifest_key(job, step, m.rank)) for m in batch),
                return_exceptions=True)
            for m, data in zip(batch, stored, strict=True):
                if isinstance(data, NotFound):
                    out.append((m, None))
                elif isinstance(data, BaseException):
                    raise data
                elif data != m.canonical():
                    out.append((m, data))
        return out

    async def _keep_committed(self, job: str, step: int, manifests: list[RankManifest]) -> None:
        """After writing the record of ``manifests``: a rank's manifest that another
        launch replaced in the moment before (its ``put_manifest`` found no record
        yet) is put back, so the record's bytes are the stored ones. That put also
        looks for the record after replacing, and puts back the same bytes."""
        for _ in range(10):
            replaced = [(m, data) for m, data in await self._replaced(job, step, manifests)
                        if data is not None]  # (a deleted one is retention's: outlasted)
            if not replaced:
                return
            for m, data in replaced:
                log.warning("%s step %d rank %d: a manifest of another launch replaced the "
                            "committed one as it committed; putting the committed one back",
                            job, step, m.rank)
                await self.store.compare_and_swap(manifest_key(job, step, m.rank), data,
                                                  m.canonical())
        raise Conflict(f"step {step} of {job}: could not keep its committed manifests in "
                       "place: too much contention")

    async def import_step(self, record: CommitRecord, manifests: Iterable[RankManifest]) -> None:
        """Copies a step committed in another repository into this one, in the write
        order: ``manifests`` (each checked against ``record``'s digest of its rank;
        every chunk it names must be here already, put with ``put_chunk``), then the
        commit record, then ``latest`` (moved forward only). Ranks not given stay
        absent: ``ckptd restore --to DIR`` copies the one rank it restores. Objects
        already here with other bytes are a ``Conflict``."""
        for manifest in manifests:
            if (manifest.job, manifest.step) != (record.job, record.step) or not (
                0 <= manifest.rank < record.world_size
            ):
                raise InvalidDocument(
                    f"rank {manifest.rank}'s manifest of step {manifest.step} of "
                    f"{manifest.job} is not part of step {record.step} of {record.job}")
            data = manifest.canonical()
            if document_hash(data) != record.manifests[manifest.rank].hash:
                raise ManifestHashMismatch(
                    f"manifest of rank {manifest.rank}, step {record.step} does not match "
                    "its commit record", rank=manifest.rank)
            ids = sorted(set(manifest.chunk_ids()))
            present = await self.store.exists_many([chunk_key(cid) for cid in ids])
            lacking = [cid for cid, ok in zip(ids, present, strict=True) if not ok]
            if lacking:
                raise MissingChunks(
                    f"manifest of rank {manifest.rank} names {len(lacking)} chunks the store "
                    f"does not hold (first {lacking[0]})", count=len(lacking), ids=lacking[:20])
            await self._put_same(manifest_key(record.job, record.step, manifest.rank), data)
        await self._put_same(commit_key(record.job, record.step), record.canonical())
        await self._advance_latest(record.job, record)

    async def _put_same(self, key: str, data: bytes) -> None:
        """Puts an immutable object, or finds the same bytes already there."""
        if not await self.store.put_if_absent(key, data) and await self.store.get(key) != data:
            raise Conflict(f"{key} already holds a different document")


def _other_launches(manifests: list[RankManifest], caller: object) -> list[int]:
    """The ranks whose manifest another launch wrote than the step's launch: the
    committing caller's (its meta's ``incarnation``) when some rank's manifest is of
    it, else the launch most ranks' manifests are of (ties: the lowest rank's)."""
    # (by their canonical JSON: an older producer's meta may hold any JSON value)
    launches = [canonical_json(manifest_incarnation(m)) for m in manifests]
    counts = Counter(launches)
    if len(counts) == 1:
        return []
    step_launch = canonical_json(caller)
    if caller is None or step_launch not in counts:
        step_launch = max(counts, key=lambda launch: (counts[launch], -launches.index(launch)))
    return [m.rank for m, launch in zip(manifests, launches, strict=True)
            if launch != step_launch]


def manifest_lacks(rank: int, lacking: list[str]) -> MissingChunks:
    """The answer to a manifest naming chunks the store lacks: the same words
    whether they are absent or only unknown to a tenant (``server.routes.manifests``)."""
    return MissingChunks(
        f"manifest of rank {rank} names {len(lacking)} chunks the store does not hold "
        f"(first {lacking[0]})",
        count=len(lacking),
        ids=lacking[:20],
    )
