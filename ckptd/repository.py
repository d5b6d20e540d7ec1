"""The repository: the commit protocol over any Store.

Write order is chunks, rank manifests, commit record, ``latest`` ref; reads go
the other way. A crash anywhere leaves only unreferenced objects, never a torn
checkpoint: a step exists only once its commit record does, and the record is
written only after every rank's manifest validated together.

Longer than the house's ~500 lines on purpose: every write of a document (chunk,
manifest, commit record, refs, timeline, rollback, an imported step) and its order
lives in this one class, so the invariants of DESIGN.md are checked in one place.
What is not a write moved out: the document thread and the parsed-manifest cache
(``documents.py``), dedup leases (``chunk_claims.py``), validation
(``validation.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

from ckptd import knobs
from ckptd.chunk_claims import ChunkClaims
from ckptd.documents import (
    MANIFEST_CACHE_ENTRIES,
    ParsedManifests,
    document_work,
    parse_stored,
)
from ckptd.errors import (
    AlreadyCommitted,
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkNotFound,
    Conflict,
    InvalidDocument,
    InvalidRequest,
    ManifestHashMismatch,
    ManifestNotFound,
    MissingChunks,
    NotCommitted,
    NotFound,
    StoreCorrupt,
    StoreError,
    Superseded,
    TooLarge,
    WorldSizeMismatch,
)
from ckptd.format import (
    JOB_RE,
    MAX_STEP,
    CommitRecord,
    ManifestRef,
    RankManifest,
    Ref,
    Timeline,
    canonical_json,
    check_chunk_id,
    check_job,
    check_step,
    chunk_key,
    commit_key,
    job_prefix,
    latest_key,
    manifest_epoch,
    manifest_key,
    step_prefix,
    timeline_key,
)
from ckptd.hashing import chunk_id, chunk_spans, document_hash
from ckptd.lifecycle import fence as gc_fence
from ckptd.lifecycle.documents import damage_key, damage_prefix
from ckptd.lifecycle.tags import TAG_META, check_tag, set_tag
from ckptd.store.base import Store
from ckptd.validation import ReplicaPolicy, validate_step

log = logging.getLogger(__name__)

_Doc = TypeVar("_Doc")


# Which of these stored chunk ids a tenant may know of (see missing_chunks).
KnownChunks = Callable[[list[str]], Awaitable[set[str]]]


@dataclass(frozen=True, slots=True)
class MissingResult:
    """Answer to a missing-chunks call: what the caller should send, and what
    another caller has claimed and is sending now (wait for those)."""

    missing: list[str]
    in_flight: list[str]


@dataclass(frozen=True, slots=True)
class CommitStatus:
    state: Literal["committed", "pending"]
    job: str
    step: int
    world_size: int | None
    missing_ranks: list[int]
    record: CommitRecord | None = None
    latest_moved: bool = True  # False: committed, but the latest ref could not be written


@dataclass(frozen=True, slots=True)
class StepInfo:
    step: int
    committed: bool
    world_size: int | None
    ranks_present: int
    logical_bytes: int | None
    committed_at: float | None
    is_latest: bool
    damaged: str | None = None  # what is wrong with the step's documents, if anything


@dataclass(frozen=True, slots=True)
class RestorableStep:
    """The step a restore of "latest" should use, and why it is not ``latest``
    itself when it is not (each problem names a damaged document)."""

    step: int | None
    problems: list[str]


@dataclass(slots=True)
class VerifyReport:
    job: str
    steps: list[int]
    chunks_checked: int = 0
    bytes_checked: int = 0
    bad_chunks: list[str] = field(default_factory=list)
    missing_chunks: list[str] = field(default_factory=list)
    bad_manifests: list[str] = field(default_factory=list)
    bad_refs: list[str] = field(default_factory=list)
    bad_commits: list[str] = field(default_factory=list)
    # Per bad or missing chunk: {"chunk", "problem", "breaks": [{"step", "rank", "tensor"}]}
    damage: list[dict[str, Any]] = field(default_factory=list)
    bytes_total: int = 0

    @property
    def ok(self) -> bool:
        return not (self.bad_chunks or self.missing_chunks or self.bad_manifests
                    or self.bad_refs or self.bad_commits)


class RollbackSet(NamedTuple):
    """What ``set_rollback`` did: the marker, the job's timeline, and whether this
    call started it (False: the rollback asked for was already set)."""

    marker: Ref
    epoch: int
    started: bool


# Chunk ids a manifest's put or commit asks the store about per call (see _lacking).
PRESENCE_BATCH = 2_000


class Repository:
    """Checkpoints of many jobs over one Store, with validation on commit."""

    def __init__(
        self,
        store: Store,
        *,
        replica_mismatch: ReplicaPolicy = "reject",
        clock: Callable[[], float] = time.time,
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
        self._manifests = ParsedManifests(MANIFEST_CACHE_ENTRIES)

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

    async def has_chunk(self, cid: str) -> bool:
        return await self.store.exists(chunk_key(cid))

    async def put_chunk(
        self, cid: str, data: bytes | memoryview, *, digest: str | None = None,
        tenant: str | None = None,
    ) -> bool:
        """Stores a chunk after checking that ``data`` hashes to ``cid``.

        ``digest`` is the hash the caller already computed while streaming the body
        in (the server does); it is then trusted instead of hashing twice."""
        check_chunk_id(cid)
        stored = False
        try:
            # Whatever happens here, the caller's claim ends: a refused or failed
            # upload must not leave other replicas waiting out the lease.
            if len(data) > knobs.MAX_CHUNK_SIZE:
                raise TooLarge(
                    f"chunk of {len(data)} bytes exceeds {knobs.MAX_CHUNK_SIZE}", id=cid
                )
            actual = digest if digest is not None else await asyncio.to_thread(chunk_id, data)
            if actual != cid:
                raise ChunkHashMismatch(
                    f"chunk body hashes to {actual}, not to its id {cid}", id=cid, actual=actual
                )
            created = await self.store.put_if_absent(chunk_key(cid), data)
            stored = True
            return created
        finally:
            claims = self._claims if tenant is None else self._tenant_claims(tenant)
            claims.release(cid, stored=stored)

    async def get_chunk(self, cid: str, *, verify: bool = True) -> bytes:
        try:
            data = await self.store.get(chunk_key(cid))
        except NotFound:
            raise ChunkNotFound(f"chunk {cid} is not in the store", id=cid) from None
        if verify:
            actual = await asyncio.to_thread(chunk_id, data)
            if actual != cid:
                raise ChunkHashMismatch(
                    f"stored chunk {cid} is corrupt (hashes to {actual})", id=cid, actual=actual
                )
        return data

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
            raise AlreadyCommitted(
                f"step {manifest.step} of {manifest.job} is committed; rank {manifest.rank}'s "
                "manifest cannot change",
                job=manifest.job,
                step=manifest.step,
                rank=manifest.rank,
            )
        epoch = manifest_epoch(manifest)
        await self._check_epoch(manifest.job, epoch, f"rank {manifest.rank}'s manifest of step "
                                f"{manifest.step}")
        ids = await asyncio.to_thread(lambda: sorted(manifest.chunk_ids()))
        await gc_fence.wait_not_sweeping(self.store)  # no presence check during a sweep
        lacking = await self._lacking(ids)
        if lacking:
            raise MissingChunks(
                f"manifest of rank {manifest.rank} names {len(lacking)} chunks the store "
                f"does not hold (first {lacking[0]})",
                count=len(lacking),
                ids=lacking[:20],
            )
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
            if manifest_epoch(await self._manifests.parse(key, existing)) >= epoch:
                raise Conflict(
                    f"rank {manifest.rank} already put a different manifest for step "
                    f"{manifest.step} of {manifest.job}; manifests are immutable, save under "
                    "a new step",
                    job=manifest.job,
                    step=manifest.step,
                    rank=manifest.rank,
                )
            # Saved before a rollback: this timeline's manifest takes its place.
            if await self.store.compare_and_swap(key, existing, data):
                self._manifests.put(key, data, manifest)
                log.info("%s step %d rank %d: a manifest of timeline %d replaces one saved "
                         "before the rollback", manifest.job, manifest.step, manifest.rank, epoch)
                return manifest.digest()
        raise Conflict(f"could not put rank {manifest.rank}'s manifest of step {manifest.step} "
                       f"of {manifest.job}: too much contention")

    async def _lacking(self, ids: list[str]) -> list[str]:
        """Which of the chunk ``ids`` the store lacks, asked PRESENCE_BATCH at a time:
        the keys (and a local store's paths) of 100,000 chunks, made in one go, held
        the event loop for a second."""
        lacking: list[str] = []
        for start in range(0, len(ids), PRESENCE_BATCH):
            batch = ids[start:start + PRESENCE_BATCH]
            present = await self.store.exists_many([chunk_key(c) for c in batch])
            lacking.extend(cid for cid, ok in zip(batch, present, strict=True) if not ok)
        return lacking

    async def _check_epoch(self, job: str, epoch: int, what: str) -> int:
        """Refuses work of a timeline other than the job's current one."""
        current = await self.epoch(job)
        if epoch < current:
            raise Superseded(
                f"{what} of {job} was saved in timeline {epoch}, which a rollback ended "
                f"(the job is in timeline {current}); restore the rollback's step first",
                job=job, epoch=epoch, current=current,
            )
        if epoch > current:
            raise Conflict(
                f"{what} of {job} names timeline {epoch}, but the job is in timeline "
                f"{current}", job=job, epoch=epoch, current=current,
            )
        return current

    async def _ranks_present(self, job: str, step: int) -> list[int]:
        names = await self.store.list_dir(f"{step_prefix(job, step)}ranks/")
        ranks = []
        for n in names:
            if n.endswith(".json") and n[:-5].isdigit():
                ranks.append(int(n[:-5]))
        return sorted(ranks)

    async def _read_manifest_raw(self, job: str, step: int, rank: int) -> RankManifest:
        try:
            data = await self.store.get(manifest_key(job, step, rank))
        except NotFound:
            raise ManifestNotFound(
                f"no manifest of rank {rank} for step {step} of {job}", rank=rank
            ) from None
        return await self._manifests.parse(manifest_key(job, step, rank), data)

    async def read_manifest(self, job: str, step: int, rank: int) -> RankManifest:
        """A rank's manifest of a committed step, checked against the commit record."""
        record = await self.read_commit(job, step)
        if not 0 <= rank < record.world_size:
            raise InvalidRequest(f"rank {rank} is outside world size {record.world_size}")
        try:
            data = await self.store.get(manifest_key(job, step, rank))
        except NotFound:
            raise ManifestNotFound(
                f"no manifest of rank {rank} for step {step} of {job}", rank=rank
            ) from None
        # Hash the stored bytes before parsing them: bytes that are not the
        # committed ones are refused whatever they say.
        expected = record.manifests[rank].hash
        if await asyncio.to_thread(document_hash, data) != expected:
            raise ManifestHashMismatch(
                f"manifest of rank {rank}, step {step} does not match its commit record",
                rank=rank,
            )
        return await self._manifests.parse(manifest_key(job, step, rank), data)

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
            check_tag(tag)
        existing = await self._try_read_commit(job, step)
        if existing is not None:
            moved = await self._advance_latest_or_say(job, existing)
            return CommitStatus("committed", job, step, existing.world_size, [], existing,
                                latest_moved=moved)
        ranks = await self._ranks_present(job, step)
        if not ranks:
            raise ManifestNotFound(f"no rank manifest for step {step} of {job}")
        epoch = await self.epoch(job)
        # One manifest says the world size; the others are read once all are in.
        first = await self._read_manifest_raw(job, step, ranks[0])
        current: dict[int, RankManifest] = {first.rank: first}
        if epoch and len(ranks) >= first.world_size:
            # Manifests saved before the last rollback count as absent: their ranks
            # put this timeline's manifest in their place when they get there.
            read = [first, *await asyncio.gather(
                *(self._read_manifest_raw(job, step, r) for r in ranks[1:]))]
            current = {m.rank: m for m in read if manifest_epoch(m) == epoch}
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
        if not await self.store.put_if_absent(commit_key(job, step), record.canonical()):
            record = await self.read_commit(job, step)  # a concurrent commit won
        else:
            log.info("committed %s step %d (%d ranks)", job, step, world)
            if tag is not None:  # ckpt.save(..., tag=...): retention keeps the step
                await set_tag(self.store, job, tag, step)
        # The record is durable: the step is committed whatever happens to the ref,
        # and the answer says so (a retry of the commit moves the ref).
        moved = await self._advance_latest_or_say(job, record)
        return CommitStatus("committed", job, step, world, [], record, latest_moved=moved)

    async def _advance_latest_or_say(self, job: str, record: CommitRecord) -> bool:
        """``_advance_latest``; False (logged) when the store refused the ref write."""
        try:
            await self._advance_latest(job, record)
        except StoreError as exc:
            log.warning("%s step %d is committed, but latest could not move: %s; the next "
                        "commit (or a retry of this one) moves it", job, record.step, exc)
            return False
        return True

    async def _advance_latest(self, job: str, record: CommitRecord) -> None:
        """Moves ``latest`` forward to ``record``'s step, never backward."""
        key = latest_key(job)
        new = Ref(step=record.step, commit=record.digest()).canonical()
        for _ in range(1000):
            try:
                current = await self.store.get(key)
            except NotFound:
                current = None
            if current is not None:
                try:
                    if Ref.parse(current).step >= record.step:
                        return
                except InvalidDocument as exc:  # damaged: a committed step repairs it
                    log.warning("%s: replacing the damaged latest ref: %s", job, exc)
            if await self.store.compare_and_swap(key, current, new):
                return
        raise Conflict(f"could not move latest of {job}: too much contention")

    # -- reads --------------------------------------------------------------------------

    async def _try_read_commit(self, job: str, step: int) -> CommitRecord | None:
        try:
            data = await self.store.get(commit_key(job, step))
        except NotFound:
            return None
        key = commit_key(job, step)
        record = parse_stored(CommitRecord.parse, data, key)
        if record.job != job or record.step != step:  # a record copied to another key
            raise StoreCorrupt(
                f"damaged document {key}: the commit record names step {record.step} of "
                f"{record.job}", key=key,
            )
        return record

    async def read_commit(self, job: str, step: int) -> CommitRecord:
        record = await self._try_read_commit(job, step)
        if record is not None:
            return record
        if await self._ranks_present(job, step):
            raise NotCommitted(f"step {step} of {job} never committed", job=job, step=step)
        raise CheckpointNotFound(f"no checkpoint at step {step} of {job}", job=job, step=step)

    async def latest(self, job: str) -> int | None:
        """The newest committed step of ``job`` that scrub has not marked damaged
        (what a restore of ``latest`` gets), or None."""
        step = await self.latest_ref_step(job)
        if step is not None and await self.store.exists(damage_key(job, step)):
            return await self.newest_undamaged_step(job)
        return step

    async def latest_ref_step(self, job: str) -> int | None:
        """The step the ``latest`` ref names, damaged or not, or None."""
        try:
            data = await self.store.get(latest_key(job))
        except NotFound:
            return None
        return parse_stored(Ref.parse, data, latest_key(job)).step

    async def newest_undamaged_step(self, job: str) -> int | None:
        """The newest committed step without a scrub damage marker, or None."""
        damaged = {n.removesuffix(".json") for n in await self.store.list_dir(damage_prefix(job))}
        for step in reversed(await self.step_numbers(job)):
            if str(step) not in damaged and await self.store.exists(commit_key(job, step)):
                return step
        return None

    async def resolve_step(self, job: str, step: int | None) -> int:
        if step is not None:
            return check_step(step)
        latest = await self.latest(job)
        if latest is None:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
        return latest

    async def list_jobs(self) -> list[str]:
        jobs = []
        for name in await self.store.list_dir("jobs/"):
            if JOB_RE.fullmatch(name):
                jobs.append(name)
            else:  # made by hand, or a stray directory: not a job, and not fatal
                log.warning("ignoring %r under jobs/: not a valid job name", name[:200])
        return jobs

    async def list_steps(self, job: str) -> list[StepInfo]:
        names = await self.store.list_dir(f"{job_prefix(job)}steps/")
        steps = sorted(int(n) for n in names if n.isdigit() and int(n) < MAX_STEP)
        try:
            latest = await self.latest(job)
        except StoreCorrupt as exc:  # the steps are still worth showing
            log.warning("%s: %s", job, exc)
            latest = None
        damaged = {n.removesuffix(".json") for n in await self.store.list_dir(damage_prefix(job))}
        sem = asyncio.Semaphore(16)

        async def info(step: int) -> StepInfo:
            async with sem:
                ranks = await self._ranks_present(job, step)
                try:
                    record = await self._try_read_commit(job, step)
                except StoreCorrupt as exc:  # one damaged step hides nothing else
                    log.warning("%s step %d: %s", job, step, exc)
                    return StepInfo(step, False, None, len(ranks), None, None, False,
                                    damaged=exc.message)
                if record is not None:
                    return StepInfo(
                        step, True, record.world_size, len(ranks),
                        record.report.logical_bytes, record.committed_at, step == latest,
                        damaged=(f"scrub found corrupt chunks ({damage_key(job, step)})"
                                 if str(step) in damaged else None),
                    )
                world = None
                if ranks:
                    try:
                        world = (await self._read_manifest_raw(job, step, ranks[0])).world_size
                    except StoreCorrupt as exc:  # one bad pending manifest hides nothing else
                        log.warning("%s step %d: unreadable manifest: %s", job, step, exc)
                return StepInfo(step, False, world, len(ranks), None, None, False)

        return list(await asyncio.gather(*(info(s) for s in steps)))

    async def restorable_step(self, job: str) -> RestorableStep:
        """The newest committed step whose ``latest`` ref and commit record read
        cleanly: ``latest`` itself unless damage makes it unusable, then the newest
        committed step below it, with the problems that made it fall back.

        This is the one place that chooses the step a restore of "latest" gets
        (scrub's damage markers belong here too)."""
        problems: list[str] = []
        ref_read = True
        try:
            newest = await self.latest(job)  # skips steps scrub marked damaged
            named = await self.latest_ref_step(job)
            if named is not None and named != newest:
                problems.append(f"step {named} of {job} is marked damaged by scrub "
                                f"({damage_key(job, named)})")
        except StoreCorrupt as exc:
            problems.append(exc.message)
            newest, ref_read = None, False
        if newest is not None and ref_read:
            try:
                if await self._try_read_commit(job, newest) is not None:
                    return RestorableStep(newest, problems)  # (a scrub fallback, if any)
                problems.append(f"latest names step {newest} of {job}, which has no commit "
                                "record")
            except StoreCorrupt as exc:
                problems.append(exc.message)
        steps = await self.step_numbers(job)
        marked = {n.removesuffix(".json") for n in await self.store.list_dir(damage_prefix(job))}
        below = [s for s in reversed(steps)
                 if (newest is None or s < newest) and str(s) not in marked]
        chosen: int | None = None
        for step in below:
            try:
                if await self._try_read_commit(job, step) is not None:
                    chosen = step
                    break
            except StoreCorrupt as exc:
                problems.append(exc.message)
        if problems:
            log.warning("%s: restoring step %s instead of latest: %s", job, chosen,
                        "; ".join(problems))
        return RestorableStep(chosen, problems)

    async def verify(
        self,
        job: str,
        step: int | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> VerifyReport:
        """Checks a job's refs, commit records and manifests, and re-hashes every
        chunk of one committed step (or of all), naming for each bad chunk the
        steps, ranks and tensors it breaks. ``progress`` gets (chunks checked,
        chunks in all), ``on_bytes`` (bytes checked, bytes in all)."""
        check_job(job)
        report = VerifyReport(job=job, steps=[])
        records: dict[int, CommitRecord] = {}
        candidates = [step] if step is not None else await self.step_numbers(job)
        for s in candidates:
            try:
                record = await self._try_read_commit(job, s)
            except StoreCorrupt as exc:
                report.bad_commits.append(exc.message)
                continue
            if record is None:
                if step is not None:
                    await self.read_commit(job, s)  # NotCommitted / CheckpointNotFound
                continue
            records[s] = record
        await self._verify_refs(job, report)
        if not records and not report.bad_commits and not report.bad_refs:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
        report.steps = sorted(records)
        sizes: dict[str, int] = {}
        users: dict[str, list[dict[str, Any]]] = {}
        for s, record in sorted(records.items()):
            for rank in range(record.world_size):
                try:
                    manifest = await self.read_manifest(job, s, rank)
                except (ManifestHashMismatch, ManifestNotFound, StoreCorrupt) as exc:
                    report.bad_manifests.append(f"step {s} rank {rank}: {exc}")
                    continue
                for e in manifest.entries:
                    spans = chunk_spans(e.nbytes, manifest.chunk_size)
                    for cid, (a, b) in zip(e.chunks, spans, strict=True):
                        sizes[cid] = b - a
                        used = users.setdefault(cid, [])
                        if len(used) < 50:  # enough to say what breaks
                            used.append({"step": s, "rank": rank, "tensor": e.name})
        total = len(sizes)
        report.bytes_total = sum(sizes.values())
        sem = asyncio.Semaphore(4)

        async def check(cid: str) -> None:
            async with sem:
                try:
                    data = await self.get_chunk(cid, verify=True)
                except ChunkNotFound:
                    report.missing_chunks.append(cid)
                    report.damage.append({"chunk": cid, "problem": "missing",
                                          "breaks": users[cid]})
                except ChunkHashMismatch:
                    report.bad_chunks.append(cid)
                    report.damage.append({"chunk": cid, "problem": "corrupt",
                                          "breaks": users[cid]})
                else:
                    report.bytes_checked += len(data)
                report.chunks_checked += 1
                if progress is not None:
                    progress(report.chunks_checked, total)
                if on_bytes is not None:
                    on_bytes(report.bytes_checked, report.bytes_total)

        await asyncio.gather(*(check(cid) for cid in sizes))
        report.bad_chunks.sort()
        report.missing_chunks.sort()
        report.damage.sort(key=lambda d: str(d["chunk"]))
        return report

    async def _verify_refs(self, job: str, report: VerifyReport) -> None:
        """``latest``, ``rollback`` and ``timeline`` parse, and each names a step
        whose commit record is there and is the one it names."""
        named: list[tuple[str, int, str]] = []
        for what, read in (("latest", self._latest_ref), ("rollback", self.read_rollback),
                           ("timeline", self.timeline)):
            try:
                ref = await read(job)
            except StoreCorrupt as exc:
                report.bad_refs.append(exc.message)
                continue
            if ref is not None:
                named.append((what, ref.step, ref.commit))
        for what, step, digest in named:
            try:
                record = await self._try_read_commit(job, step)
            except StoreCorrupt:
                report.bad_refs.append(f"{what} of {job} names step {step}, whose commit "
                                       "record is damaged")
                continue
            if record is None:
                report.bad_refs.append(f"{what} of {job} names step {step}, which has no "
                                       "commit record (deleted, or never complete)")
            elif record.digest() != digest:
                report.bad_refs.append(f"{what} of {job} names a commit of step {step} "
                                       "that is not the stored one")

    async def _latest_ref(self, job: str) -> Ref | None:
        try:
            data = await self.store.get(latest_key(job))
        except NotFound:
            return None
        return parse_stored(Ref.parse, data, latest_key(job))

    # -- rollback marker and step listings (the server's liveness views) -------------

    @staticmethod
    def _rollback_key(job: str) -> str:
        return f"{job_prefix(job)}refs/rollback"

    async def read_rollback(self, job: str) -> Ref | None:
        """The job's rollback marker (a Ref to a committed step), or None."""
        try:
            data = await self.store.get(self._rollback_key(job))
        except NotFound:
            return None
        return parse_stored(Ref.parse, data, self._rollback_key(job))

    async def rollback_state(self, job: str) -> tuple[Ref | None, int]:
        """The rollback marker (None when clear) and the job's epoch, as one pair.

        ``set_rollback`` writes the timeline, then the marker: between the two a
        reader sees the new epoch with the previous marker. The timeline holds the
        newest rollback's target, so while a marker is set, that is the answer."""
        timeline = await self.timeline(job)
        marker = await self.read_rollback(job)
        if timeline is None:
            return marker, 0
        if marker is None:
            return None, timeline.epoch
        return Ref(step=timeline.step, commit=timeline.commit), timeline.epoch

    async def epoch(self, job: str) -> int:
        """The job's current timeline: how many rollbacks it has had (0: none)."""
        timeline = await self.timeline(job)
        return timeline.epoch if timeline is not None else 0

    async def timeline(self, job: str) -> Timeline | None:
        try:
            data = await self.store.get(timeline_key(check_job(job)))
        except NotFound:
            return None
        return parse_stored(Timeline.parse, data, timeline_key(job))

    async def set_rollback(self, job: str, step: int, *, from_epoch: int | None = None
                           ) -> RollbackSet:
        """Marks ``job`` to go back to committed ``step`` (``NotCommitted`` or
        ``CheckpointNotFound`` otherwise) and starts a new timeline: manifests saved
        before it are refused from now on.

        ``from_epoch`` is the timeline the asking rank is in. A rank that has not yet
        rolled back to the latest rollback asks from an ended timeline: while that
        rollback is marked, its request is already answered, and the current marker
        and epoch come back unchanged."""
        record = await self.read_commit(job, step)
        new = Ref(step=step, commit=record.digest())
        # The timeline first: between the two writes, saves are refused until the
        # marker tells the ranks to roll back; the other order could let a rank
        # restore, see the old epoch and keep it.
        key = timeline_key(job)
        for _ in range(100):
            try:
                current: bytes | None = await self.store.get(key)
            except NotFound:
                current = None
            done = parse_stored(Timeline.parse, current, key) if current is not None else None
            epoch = done.epoch if done is not None else 0
            # Asked from an ended timeline while its rollback is still marked: that
            # rollback answers it. (Once the marker is cleared, it is a new one.)
            if (done is not None and from_epoch is not None and from_epoch < epoch
                    and await self.read_rollback(job) is not None):
                return RollbackSet(Ref(step=done.step, commit=done.commit), epoch,
                                   started=False)
            data = Timeline(epoch=epoch + 1, step=step, commit=new.commit).canonical()
            if await self.store.compare_and_swap(key, current, data):
                epoch += 1
                break
        else:
            raise Conflict(f"could not start a new timeline of {job}: too much contention")
        data = new.canonical()
        key = self._rollback_key(job)
        for _ in range(100):
            try:
                current = await self.store.get(key)
            except NotFound:
                current = None
            if current == data or await self.store.compare_and_swap(key, current, data):
                log.info("rollback of %s set to step %d (timeline %d)", job, step, epoch)
                return RollbackSet(new, epoch, started=True)
        raise Conflict(f"could not set the rollback marker of {job}: too much contention")

    async def clear_rollback(self, job: str) -> bool:
        """Removes the job's rollback marker; True when there was one."""
        key = self._rollback_key(check_job(job))
        try:
            seen = await self.store.get(key)
        except NotFound:
            return False
        # Compare-and-delete: a rollback set after we looked (a newer one) stays.
        if not await self.store.compare_and_delete(key, seen):
            log.info("rollback of %s changed while clearing it; the newer one stays", job)
            return False
        log.info("rollback of %s cleared", job)
        return True

    async def step_numbers(self, job: str) -> list[int]:
        """Every step of ``job`` that has a directory (committed or pending), ascending."""
        names = await self.store.list_dir(f"{job_prefix(job)}steps/")
        return sorted(int(n) for n in names if n.isdigit() and int(n) < MAX_STEP)

    async def try_read_commit(self, job: str, step: int) -> CommitRecord | None:
        """The commit record of ``step``, or None when it has not committed."""
        return await self._try_read_commit(job, step)

    async def ranks_present(self, job: str, step: int) -> list[int]:
        """The ranks whose manifests of ``step`` are in the store."""
        return await self._ranks_present(job, step)

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
