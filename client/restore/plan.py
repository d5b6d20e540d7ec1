"""The restore plan: the committed step, the manifest whose tree is restored,
every rank's manifest when the boxes need them, and who holds each chunk."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ckptd.errors import CheckpointNotFound, CkptdError, InvalidDocument, NotCommitted
from ckptd.format import CommitRecord, RankManifest, canonical_json, check_step
from ckptd.hashing import document_hash

from ..transport import HttpTransport, Transport
from .sources import ChunkProblem

log = logging.getLogger(__name__)


# The manifest ``meta`` key of a rank manifest ``torch.distributed.checkpoint``
# wrote (``client/dcp``): its tree is flat, ``{fqn: node}``. DCP's planner saves each
# item that several ranks hold at one place (a plain tensor, bytes, a value) once,
# on a rank it picks, so such a rank's tree holds only what it wrote.
DCP_META = "dcp"
# Its key naming the fqns this rank planned that DCP saved on another rank (an item
# several ranks hold is saved once): a restore of this rank takes those, and no other
# rank's items (a pipeline stage's rank is not given every stage's). Absent in steps
# saved before ckptd wrote it: a restore then takes every item the rank lacks.
DCP_ELSEWHERE = "elsewhere"


@dataclass(slots=True)
class RestorePlan:
    """A committed step to restore, this rank's manifest, and who holds its chunks."""

    job: str
    step: int
    rank: int  # the rank whose manifest gives the tree
    record: CommitRecord
    manifest: RankManifest
    peers: dict[str, list[str]] = field(default_factory=dict)
    manifests: dict[int, RankManifest] = field(default_factory=dict)  # every rank, when read
    peer_token: str | None = None  # the job's peer token, from the server's plan
    # Damaged documents that made "latest" an older step (see restorable_step).
    fallback: list[str] = field(default_factory=list)
    # Over an object store: presigned GET URLs of the manifest's chunks (chunk id ->
    # URL), valid ``reads_expire_in`` seconds from ``planned_at`` (time.monotonic).
    reads: dict[str, str] = field(default_factory=dict)
    reads_expire_in: float | None = None
    planned_at: float | None = None
    # Entry names the tree takes from another rank's manifest (``with_items_saved_once``).
    elsewhere: set[str] = field(default_factory=set)

    @property
    def world_size(self) -> int:
        return self.record.world_size


async def resolve_step(transport: Transport, job: str, step: int | None) -> int:
    if step is not None:
        return check_step(step)
    latest = await transport.latest(job)
    if latest is None:
        raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
    return latest


@dataclass(slots=True)
class PlanReply:
    """What a server's restore plan for one rank said."""

    manifest: RankManifest | None = None  # None when the server sent none
    peers: dict[str, list[str]] = field(default_factory=dict)  # chunk id -> holders
    digest: str | None = None  # the manifest's hash
    peer_token: str | None = None  # what those peers require
    reads: dict[str, str] = field(default_factory=dict)  # chunk id -> presigned URL
    reads_expire_in: float | None = None
    answered_at: float | None = None  # time.monotonic() when it came


async def fetch_restore_plan(transport: Transport, job: str, rank: int, step: int
                             ) -> PlanReply:
    """The server's restore plan for ``rank`` at ``step`` (``PlanReply``).
    An HTTP transport only; a server without the route gives no peers."""
    if not isinstance(transport, HttpTransport):
        return PlanReply()
    try:
        doc = await transport.restore_plan(job, rank, step)
    except (CheckpointNotFound, NotCommitted):
        raise
    except CkptdError as exc:
        log.info("no restore plan from %s (%s); restoring without peers", transport.url, exc)
        return PlanReply()
    answered_at = time.monotonic()
    peers_doc = doc.get("peers") or {}
    peers = {str(cid): [str(u) for u in urls if isinstance(u, str)]
             for cid, urls in peers_doc.items() if isinstance(urls, list)}
    manifest = None
    digest = doc.get("manifest_hash")
    body = doc.get("manifest")
    if isinstance(body, dict):
        try:
            manifest = RankManifest.parse(canonical_json(body))
        except (CkptdError, TypeError, ValueError) as exc:
            log.warning("restore plan's manifest does not parse (%s); reading it", exc)
    token = doc.get("peer_token")
    reads_doc = doc.get("reads") or {}
    reads = {str(cid): url for cid, url in reads_doc.items() if isinstance(url, str)}
    expire_in = doc.get("reads_expire_in")
    return PlanReply(manifest, peers, digest if isinstance(digest, str) else None,
                     token if isinstance(token, str) else None, reads,
                     float(expire_in) if isinstance(expire_in, int | float) else None,
                     answered_at)


async def _restorable(transport: Transport, job: str, step: int | None) -> tuple[int, list[str]]:
    """``step``, or the step a restore of "latest" gets and the damaged documents
    that made it older than ``latest``."""
    if step is not None:
        return step, []
    found, fallback = await transport.restorable(job)
    if found is None:
        raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
    return found, fallback


async def load_plan(
    transport: Transport, job: str, rank: int, step: int | None, *, with_peers: bool = True
) -> RestorePlan:
    """Resolves the step, refuses a step that never committed, and reads the
    manifest whose tree is restored (this rank's; rank 0's when this rank is
    outside the committed world) with the peers that hold its chunks."""
    step, fallback = await _restorable(transport, job, step)
    step = await resolve_step(transport, job, step)
    record = await transport.read_commit(job, step)  # NotCommitted, CheckpointNotFound
    source_rank = rank if rank < record.world_size else 0
    reply = PlanReply()
    if with_peers:
        reply = await fetch_restore_plan(transport, job, source_rank, step)
    manifest, peers, peer_token = reply.manifest, reply.peers, reply.peer_token
    expected = record.manifests[source_rank].hash
    if manifest is not None and document_hash(manifest.canonical()) != expected:
        log.warning("restore plan's manifest of rank %d is not the committed one; reading it",
                    source_rank)
        manifest = None
    if manifest is None or (manifest.job, manifest.step, manifest.rank) != (
        job, step, source_rank
    ):
        manifest = await transport.read_manifest(job, step, source_rank, record)
    plan = RestorePlan(job, step, source_rank, record, manifest, peers, peer_token=peer_token,
                       fallback=fallback, reads=reply.reads,
                       reads_expire_in=reply.reads_expire_in, planned_at=reply.answered_at)
    plan.manifests[source_rank] = manifest
    return plan


async def load_all_manifests(transport: Transport, plan: RestorePlan, with_peers: bool) -> None:
    """Reads every rank's manifest of the plan's step (and their peers): from a
    server, one step plan (``load_step``); else a read per rank."""
    if with_peers and isinstance(transport, HttpTransport):
        full = await load_step(transport, plan.job, plan.rank, plan.step)
        if full.step == plan.step and full.record.manifests == plan.record.manifests:
            for r, manifest in full.manifests.items():
                plan.manifests.setdefault(r, manifest)
            plan.peer_token = plan.peer_token or full.peer_token
            for cid, urls in full.peers.items():
                have = plan.peers.setdefault(cid, [])
                have.extend(u for u in urls if u not in have)
            return

    async def one(r: int) -> None:
        if r in plan.manifests:
            return
        manifest: RankManifest | None = None
        if with_peers:
            reply = await fetch_restore_plan(transport, plan.job, r, plan.step)
            manifest = reply.manifest
            plan.peer_token = plan.peer_token or reply.peer_token
            for cid, urls in reply.peers.items():
                have = plan.peers.setdefault(cid, [])
                have.extend(u for u in urls if u not in have)
            if manifest is not None and document_hash(manifest.canonical()) != (
                plan.record.manifests[r].hash
            ):
                manifest = None
        if manifest is None:
            manifest = await transport.read_manifest(plan.job, plan.step, r, plan.record)
        plan.manifests[r] = manifest

    await asyncio.gather(*(one(r) for r in range(plan.world_size)))


async def load_step(transport: Transport, job: str, rank: int, step: int | None) -> RestorePlan:
    """A committed step with every rank's manifest (the latest restorable step when
    ``step`` is None) and the live peers holding its chunks, for a load into any
    world size: one request to a server (its step plan), each manifest checked
    against the commit record; read from the store itself over ``file://`` (no
    peers). ``rank``: the loading rank (never its own peer; the tree's manifest)."""
    if not isinstance(transport, HttpTransport):
        step, fallback = await _restorable(transport, job, step)
        record = await transport.read_commit(job, step)
        read = await asyncio.gather(*(transport.read_manifest(job, step, r)
                                      for r in range(record.world_size)))
        source = rank if rank < record.world_size else 0
        return RestorePlan(job, step, source, record, read[source],
                           manifests=dict(enumerate(read)), fallback=fallback)
    doc = await transport.step_plan(job, rank, step)
    record = doc.commit
    if (record.job, record.step, doc.job, doc.world_size) != (job, doc.step, job,
                                                              record.world_size) or (
            step is not None and doc.step != step) or len(doc.manifests) != record.world_size:
        raise InvalidDocument(f"the step plan of {job} step {doc.step} does not match its "
                              "commit record")

    async def checked(r: int, manifest: RankManifest) -> RankManifest:
        if document_hash(manifest.canonical()) == record.manifests[r].hash and (
            manifest.job, manifest.step, manifest.rank) == (job, doc.step, r):
            return manifest
        # Read on its own: that read checks the stored bytes and names the damage.
        log.warning("step plan's manifest of rank %d is not the committed one; reading it", r)
        return await transport.read_manifest(job, doc.step, r, record)

    manifests = await asyncio.gather(*(checked(r, m) for r, m in enumerate(doc.manifests)))
    # A holder's pool holds its own manifest's chunks (the server's restore plan says
    # the same per rank); the holders come best first.
    peers: dict[str, list[str]] = {}
    for holder in doc.holders:
        if 0 <= holder.rank < record.world_size:
            for cid in manifests[holder.rank].chunk_ids():
                urls = peers.setdefault(cid, [])
                if holder.url not in urls:
                    urls.append(holder.url)
    source = rank if rank < record.world_size else 0
    return RestorePlan(job, doc.step, source, record, manifests[source], peers,
                       dict(enumerate(manifests)), peer_token=doc.peer_token,
                       fallback=list(doc.fallback))


def fallback_problems(plan: RestorePlan) -> list[ChunkProblem]:
    """The damaged documents that made a restore of "latest" use an older step."""
    return [
        ChunkProblem(chunk="", tier="store", source="latest", kind="damaged", message=m)
        for m in plan.fallback
    ]


def written_by_dcp(manifest: RankManifest) -> bool:
    """Whether ``torch.distributed.checkpoint`` wrote ``manifest`` (``DCP_META``)."""
    return isinstance(manifest.meta.get(DCP_META), dict)


async def add_items_saved_once(transport: Transport, plan: RestorePlan,
                               with_peers: bool, world_size: int) -> bool:
    """Whether DCP wrote the plan's step (``written_by_dcp``); when it did, with
    several ranks, the plan's manifest becomes ``with_items_saved_once``'s (every
    rank's manifest read; at the step's own world size, only the items its rank
    planned, where its manifest lists them). Not for ``ckptd restore --to DIR``: it
    stores the rank's manifest as committed."""
    if not written_by_dcp(plan.manifest):
        return False
    same_world = world_size == plan.world_size
    if same_world and plan.manifest.meta[DCP_META].get(DCP_ELSEWHERE) == []:
        return True  # (nothing it planned was saved elsewhere: its manifest is all)
    if plan.world_size > 1:
        await load_all_manifests(transport, plan, with_peers)
        plan.manifest = with_items_saved_once(plan, same_world)
    return True


def with_items_saved_once(plan: RestorePlan, planned_only: bool = False) -> RankManifest:
    """The manifest whose tree a rank restores of a step DCP wrote (every rank's
    manifest read): the plan's own, plus every item of the step's other ranks that
    it lacks, as the lowest rank holding it stored it (its tree node and entries,
    named in ``plan.elsewhere``). DCP saved each item several ranks held once, on
    one rank, and ``dcp.load`` gives it to every rank that asks: DCP has no
    rank-private state, so neither has a restore of its step. ``planned_only`` (the
    step's own world size): of those, only the items the rank's manifest names as
    saved elsewhere (``DCP_ELSEWHERE``; all where it names none), so a pipeline
    stage's rank is not given every stage's items."""
    own = plan.manifest
    listed = own.meta[DCP_META].get(DCP_ELSEWHERE) if planned_only else None
    wanted = set(map(str, listed)) if isinstance(listed, list) else None
    names = {key for key, _ in own.tree.get("dict", [])}
    taken = {e.name for e in own.entries}
    tree = list(own.tree.get("dict", []))
    entries = list(own.entries)
    for r in sorted(plan.manifests):
        m = plan.manifests[r]
        if r == plan.rank or not written_by_dcp(m):
            continue
        for key, node in m.tree.get("dict", []):
            if key in names or (wanted is not None and key not in wanted):
                continue
            ((kind, body),) = node.items()
            named = body if kind in ("tensor", "bytes") else None
            if named is not None and named in taken:
                continue  # (not a tree a DCP writer makes: the entry's name is its key)
            names.add(key)
            tree.append([key, node])
            if named is not None:
                taken.add(named)
                plan.elsewhere.add(named)
                entries.extend(e for e in m.entries if e.name == named)
    if len(tree) == len(own.tree.get("dict", [])):
        return own
    return own.model_copy(update={"tree": {"dict": tree}, "entries": entries})
