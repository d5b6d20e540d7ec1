"""A whole restore for a Checkpointer (``Restorer``): plan, layout, fetch through
the tiers in two phases (verify everything, then deliver), fill the target; and
adopting this rank's staging pool after a restart."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ckptd import knobs
from ckptd.errors import (
    CheckpointNotFound,
    CkptdError,
    InvalidRequest,
    RestoreError,
    Timeout,
    UnsupportedFormat,
)
from ckptd.format import TensorEntry
from ckptd.hashing import chunk_id

from ..failures import wrap_error
from ..loop import in_thread
from ..peer import PeerClient, PeerIndex
from ..session import Session
from ..staging.pool import StagingPool
from ..stateful import restore_view
from ..transport import Transport
from .devices import DeviceOrder, to_devices
from .direct import ObjectStoreSource
from .failure import failure
from .fetch import ChunkFetcher, WantedChunks, deliver
from .fill import fill, plan_fill
from .keys import Kind, Path, check_keys, check_places, stateful_kinds, stateful_places
from .layout import RestoreLayout, _target_values, build_layout, needed_boxes
from .memory import Landing
from .plan import (
    RestorePlan,
    add_items_saved_once,
    fallback_problems,
    load_all_manifests,
    load_plan,
    resolve_step,
)
from .sources import (
    TIERS,
    ChunkProblem,
    DirectoryCacheSource,
    LocalPoolSource,
    LocalStoreSource,
    PeerSource,
    PoolAhead,
    Source,
    StoreSource,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What a restore did: the step, bytes and chunks restored, time, how many
    bytes came from each tier (``local``, ``cache``, ``peer``, ``store``, and
    ``object``: the store tier's chunks read straight from an object store through
    presigned URLs, not through the server), and the sources that failed on the
    way (each chunk still came from another)."""

    step: int
    bytes_restored: int
    chunks: int
    seconds: float
    bytes_from: dict[str, int] = field(default_factory=dict)
    problems: list[ChunkProblem] = field(default_factory=list)
    world_size: int | None = None  # the committed step's world size
    elastic: bool = False  # boxes were cut from other ranks' entries

    @property
    def bytes_fetched(self) -> int:
        return sum(self.bytes_from.values())


@dataclass(slots=True)
class RestoreOptions:
    """Which tiers a restore uses and how."""

    local: bool = True
    pool_root: str | os.PathLike[str] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    peers: bool = True
    store: bool = True
    exclude_peers: tuple[str, ...] = ()
    token: str | None = None
    concurrency: int | None = None
    peer_timeout: float | None = None
    atomic: bool = True  # nothing reaches the target before every chunk verified
    strict: bool = True  # the target's keys match the checkpoint's (``keys.check_keys``)
    stateful: dict[Path, Kind] = field(default_factory=dict)  # where Stateful objects sit
    places: dict[Path, str] = field(default_factory=dict)  # and their types (check_places)


@dataclass(slots=True)
class Written:
    """Whether a restore has written into its target yet: an error after that says
    the target is partly restored (a deadline can pass during delivery)."""

    target: bool = False


@dataclass(slots=True)
class Fetched:
    """Assembled, verified tensors of a layout, and what the fetch did."""

    tensors: dict[str, torch.Tensor]
    chunks: int
    bytes_from: dict[str, int]
    problems: list[ChunkProblem]
    adopted: PeerIndex | None  # verified chunks of this rank's pool, to serve to peers
    pool: LocalPoolSource | None  # keeps the adopted views mapped


def make_sources(
    transport: Transport,
    plan: RestorePlan,
    layout_entries: Iterable[tuple[TensorEntry, int]],
    opts: RestoreOptions,
    pool_rank: int,
    ahead: PoolAhead | None = None,
) -> tuple[list[Source], LocalPoolSource | None]:
    sources: list[Source] = []
    pool = None
    if opts.local:
        try:
            pool = LocalPoolSource.open(plan.job, pool_rank, layout_entries, opts.pool_root,
                                        ahead)
        except Exception as exc:  # a pool we cannot read is a pool we do not have
            log.warning("cannot read the staging pool of %s/%d: %s", plan.job, pool_rank, exc)
            pool = None
        if pool is not None:
            sources.append(pool)
    cache = opts.cache_dir if opts.cache_dir is not None else knobs.cache_dir()
    if cache:
        sources.append(DirectoryCacheSource(cache))
    if opts.peers and plan.peers:
        # The job's peer token from the plan: never this client's server token.
        client = PeerClient(plan.peer_token, timeout=opts.peer_timeout)
        sources.append(PeerSource(plan.peers, client, exclude=opts.exclude_peers))
    if opts.store:
        # Over an object store, its presigned URLs first: the server is the fallback.
        direct = ObjectStoreSource.of(plan.reads, plan.reads_expire_in, plan.planned_at)
        if direct is not None:
            sources.append(direct)
        sources.append(LocalStoreSource.of(transport) or StoreSource(transport))
    return sources, pool


async def fetch_layout(
    transport: Transport, plan: RestorePlan, layout: RestoreLayout, opts: RestoreOptions,
    pool_rank: int, written: Written | None = None, adopt: bool = True,
    ahead: PoolAhead | None = None,
) -> Fetched:
    """Fetches and verifies every chunk of ``layout`` through the tiers and
    assembles the tensors; raises (nothing assembled) when a chunk had no good
    source. ``written`` learns when the target is first written. ``adopt``: keep
    the pool's verified chunks mapped, to serve them to peers (else the pool is
    unmapped on a thread of its own). ``ahead``: the pool, opened already."""
    sources, pool = make_sources(transport, plan, layout.entries, opts, pool_rank, ahead)
    fetcher = ChunkFetcher(sources, opts.concurrency)
    keep_pool = False
    wanted = layout.wanted
    found: dict[str, memoryview] = {}
    written = written if written is not None else Written()
    t0 = time.perf_counter()
    try:
        # Phase 1: every chunk verified somewhere; nothing written into the target
        # (unless not atomic: chunks from the network land in it as they verify).
        found = await fetcher.locate_all(wanted, opts.atomic)
        t1 = time.perf_counter()
        if fetcher.failed:
            raise _stated(failure(fetcher, wanted, plan.step), plan.step,
                          fetcher.landed_in_target)
        if pool is not None and not pool.unchanged():
            # A live owner staged into the pool meanwhile: what was verified there
            # may be gone. Take those chunks from the other tiers.
            try:
                await _relocate(fetcher, wanted, found, [s for s in sources if s is not pool])
            except CkptdError as exc:
                raise _stated(exc, plan.step, fetcher.landed_in_target) from None
        # Phase 2: deliver (into the target's own tensors where they fit).
        written.target = True
        await deliver(found, wanted, prefilled=fetcher.prefilled, sent=fetcher.sent,
                      on_device=fetcher.on_device)
        log.debug("%s step %d: chunks verified in %.4f s, delivered in %.4f s", plan.job,
                  plan.step, t1 - t0, time.perf_counter() - t1)
        if pool is not None and not pool.unchanged():
            try:
                await _recheck(fetcher, wanted, [s for s in sources if s is not pool])
            except CkptdError as exc:  # after delivery: the target holds what the pool gave
                raise _stated(exc, plan.step, True) from None
        adopted = None
        if adopt and pool is not None and pool.unchanged():
            verified = {cid: found[cid] for cid, tier in fetcher.tier_of.items()
                        if tier == "local"}
            if verified and _whole(plan, pool_rank, verified):
                # Served while nobody stages into that pool (its seqlock generation).
                adopted = PeerIndex(step=plan.step, chunks=verified, valid=pool.unchanged)
                keep_pool = True
        return Fetched(
            tensors=layout.buffers,
            chunks=len(wanted.chunks),
            bytes_from=dict(fetcher.bytes_from),
            problems=list(fetcher.problems),
            adopted=adopted,
            pool=pool if keep_pool else None,
        )
    finally:
        written.target = written.target or fetcher.landed_in_target
        fetcher.stop_prefault()
        found.clear()  # (views of the pool: a view left would keep it mapped here)
        fetcher.on_device.clear()  # (device memory beside the target: given back)
        for s in sources:
            if s is pool and keep_pool:
                continue
            s.close()
            if isinstance(s, PeerSource):
                s.client.close()


def _whole(plan: RestorePlan, rank: int, verified: Mapping[str, memoryview]) -> bool:
    """True when the pool gave every chunk of ``rank``'s manifest of the plan's step
    (``serves_whole``)."""
    manifest = plan.manifests.get(rank)
    return manifest is not None and serves_whole(plan.job, rank, plan.step,
                                                 manifest.chunk_ids(), verified)


def serves_whole(job: str, rank: int, step: int, needed: set[str],
                 verified: Mapping[str, memoryview]) -> bool:
    """True when ``verified`` holds every chunk of ``needed`` (a rank's manifest of
    ``step``). A rank that serves a step is a holder of its whole manifest to the
    server's planner: a pool holding part of it (a newer save that never committed
    overwrote the rest) would send a replacement's requests to a peer that answers
    404, so it is not served at all (said in the log)."""
    held = len(needed & verified.keys())
    if held < len(needed):
        if held:
            log.info("%s/%d: the staging pool holds %d of the %d chunks of step %d: not "
                     "served to peers", job, rank, held, len(needed), step)
        return False
    return True


def _stated(err: CkptdError, step: int, partial: bool) -> CkptdError:
    """``err`` naming the step, and saying so when the target was written."""
    if err.detail.get("step", -1) == -1:
        err.detail["step"] = step
    if partial and not err.detail.get("partial"):
        err.detail["partial"] = True
        err.message = err.args[0] + "; the target is partly restored"
        err.args = (err.message,)
    return err


async def _relocate(fetcher: ChunkFetcher, wanted: WantedChunks, found: dict[str, memoryview],
                    others: Sequence[Source]) -> None:
    """Finds again, in ``others``, the chunks that were found in the local pool."""
    # (What went to a device as it was hashed is there verified: not fetched again.)
    local = [cid for cid, tier in fetcher.tier_of.items()
             if tier == "local" and cid not in fetcher.sent and cid not in fetcher.on_device]
    log.warning("the staging pool changed during the restore; %d chunks from other tiers",
                len(local))
    again = ChunkFetcher(others, fetcher.concurrency)
    landing = Landing()
    for cid in local:
        fetcher.prefilled.pop(cid, None)  # what was copied from the pool is suspect too
        fetcher.bytes_from["local"] -= wanted.size(cid)
        size = wanted.size(cid)
        data = await again.locate(cid, size, functools.partial(landing.take, size))
        if data is None:
            fetcher.failed[cid] = again.failed[cid]
        else:
            found[cid] = data
            fetcher.tier_of[cid] = again.tier_of[cid]
    for tier, n in again.bytes_from.items():
        fetcher.bytes_from[tier] = fetcher.bytes_from.get(tier, 0) + n
    fetcher.problems.extend(again.problems)
    fetcher.unreached.update(again.unreached)  # (a store lost meanwhile: Unavailable)
    if fetcher.failed:
        raise failure(fetcher, wanted, -1)


async def _recheck(fetcher: ChunkFetcher, wanted: WantedChunks, others: Sequence[Source]) -> None:
    """The pool changed while it was being copied out: re-hashes what it gave,
    where it landed, and fetches again from ``others`` whatever no longer verifies."""
    again = ChunkFetcher(others, fetcher.concurrency)
    landing = Landing()
    for cid, tier in list(fetcher.tier_of.items()):
        if tier != "local" or cid in fetcher.sent or cid in fetcher.on_device:
            # (verified as they were sent: in the target, or copied there on the device)
            continue
        for dest, _ in wanted.chunks[cid]:
            if await in_thread(chunk_id, dest) == cid:
                continue
            if await again.fetch(cid, dest) is None:
                raise failure(again, wanted, -1)
        for device_dest in wanted.devices.get(cid, ()):
            copied = await in_thread(device_dest.cpu)  # (the copies finished)
            if await in_thread(chunk_id, copied.numpy().data) == cid:
                continue
            size = wanted.size(cid)
            data = await again.locate(cid, size, functools.partial(landing.take, size))
            if data is None:
                raise failure(again, wanted, -1)
            await in_thread(to_devices, {cid: data}, {cid: [device_dest]},
                                    wanted.device_order)
    # An elastic box's slices were cut from those destinations before they were
    # checked: cut them again from what is there now.
    if wanted.copies:
        await in_thread(_copy_slices, wanted.copies)
    fetcher.problems.extend(again.problems)


def _copy_slices(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)


def restore_into(
    call: Callable[[Coroutine[Any, Any, Any]], Any],
    transport: Transport,
    state: Any,
    *,
    job: str,
    rank: int,
    world_size: int,
    step: int | None = None,
    shards: Mapping[str, Any] | None = None,
    opts: RestoreOptions | None = None,
    adopt: bool = True,
) -> tuple[RestoreResult, Fetched]:
    """Restores ``state`` in place (see ``Checkpointer.restore``); ``call`` runs a
    coroutine on the loop the transport lives on and returns its result. ``adopt``:
    keep the pool's verified chunks mapped (``Fetched.adopted``) to serve them."""
    t0 = time.perf_counter()
    opts = opts or RestoreOptions()
    # The pool's pages are read in while the plan loads (the cores wait on the
    # server then), one thread per core but one (the plan's own work).
    ahead = PoolAhead.open(job, rank, opts.pool_root, max(1, (os.cpu_count() or 1) - 1)
                           ) if opts.local else None
    log.debug("%s/%d: pool opened in %.4f s", job, rank, time.perf_counter() - t0)
    try:
        return _restore_planned(call, transport, state, job=job, rank=rank,
                                world_size=world_size, step=step, shards=shards, opts=opts,
                                adopt=adopt, ahead=ahead, t0=t0)
    finally:
        if ahead is not None:
            ahead.close()


def _restore_planned(
    call: Callable[[Coroutine[Any, Any, Any]], Any], transport: Transport, state: Any, *,
    job: str, rank: int, world_size: int, step: int | None, shards: Mapping[str, Any] | None,
    opts: RestoreOptions, adopt: bool, ahead: PoolAhead | None, t0: float,
) -> tuple[RestoreResult, Fetched]:
    # The server's plan names the peers, and over an object store carries the URLs
    # that read it directly: asked for when either is wanted.
    planned = opts.peers or (opts.store and knobs.direct_reads())
    plan: RestorePlan = call(load_plan(transport, job, rank, step, with_peers=planned))
    t_plan = time.perf_counter()
    if ahead is not None and ahead.reader.step != plan.step:
        ahead.stop()  # (another step's pool: what it may still give is read as it is)
    # A step DCP wrote has no rank-local state: each rank takes what DCP saved elsewhere.
    by_dcp = call(add_items_saved_once(transport, plan, opts.peers, world_size))
    if plan.rank != rank and not by_dcp:
        log.warning("%s/%d: step %d was saved by %d ranks; rank-local entries come from "
                    "rank %d", job, rank, plan.step, plan.world_size, plan.rank)
    elif rank == 0 and world_size < plan.world_size and not by_dcp:  # (said once, by rank 0)
        gone = (f"rank {world_size}" if world_size == plan.world_size - 1
                else f"ranks {world_size}-{plan.world_size - 1}")
        log.warning("%s: step %d was saved by %d ranks and this launch has %d: sharded "
                    "tensors are resharded, and the rank-local entries of %s (an RNG "
                    "state, say) are restored by no rank", job, plan.step, plan.world_size,
                    world_size, gone)
    check_places(plan.manifest.tree, opts.places, plan.step)
    if opts.strict:  # before anything changes, like plan_fill below
        check_keys(plan.manifest.tree, state, opts.stateful, plan.step)
    boxes, other = needed_boxes(plan, state, shards or {}, world_size)
    if other:
        call(load_all_manifests(transport, plan, opts.peers))
    values = _target_values(plan.manifest.tree, state)
    layout = build_layout(plan, boxes, values)
    plan_fill(state, layout.tree, layout.specs)  # refuses before anything changes
    if layout.wanted.devices:  # device copies run on another thread: follow this one's
        layout.wanted.device_order = DeviceOrder.here(
            t.device for dests in layout.wanted.devices.values() for t in dests)
    t_layout = time.perf_counter()
    written = Written()
    try:
        fetched: Fetched = call(fetch_layout(transport, plan, layout, opts, rank, written,
                                             adopt, ahead))
    except CkptdError as exc:  # (a deadline that passed during delivery, too)
        raise _stated(exc, plan.step, written.target) from exc.__cause__
    t_fetch = time.perf_counter()
    try:
        fill(state, layout.tree, fetched.tensors)
    except CkptdError as exc:
        raise _stated(exc, plan.step, True) from exc.__cause__
    except Exception as exc:  # (a device's error in a copy into the target: checked before)
        what = f"the copy of step {plan.step} into the target"
        raise _stated(wrap_error(exc, what, RestoreError), plan.step, True) from exc
    log.debug("%s/%d: plan %.4f s, layout %.4f s, fetch %.4f s, fill %.4f s", job, rank,
              t_plan - t0, t_layout - t_plan, t_fetch - t_layout, time.perf_counter() - t_fetch)
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in fetched.tensors.values())
    result = RestoreResult(
        step=plan.step,
        bytes_restored=nbytes,
        chunks=fetched.chunks,
        seconds=seconds,
        bytes_from=fetched.bytes_from,
        problems=[*fallback_problems(plan), *fetched.problems],
        world_size=plan.world_size,
        elastic=layout.wanted.elastic,
    )
    log.info("%s/%d: restored step %d, %d bytes in %d chunks, %.3f s (%s)%s", job, rank,
             plan.step, nbytes, fetched.chunks, seconds,
             ", ".join(f"{t} {n}" for t, n in fetched.bytes_from.items() if n),
             f", {len(fetched.problems)} source problems" if fetched.problems else "")
    return result, fetched


async def adopt_pool(
    transport: Transport, job: str, rank: int, step: int | None,
    pool_root: str | os.PathLike[str] | None = None,
) -> tuple[int, PeerIndex | None, LocalPoolSource | None]:
    """Verifies this rank's staging pool against the manifest of a committed step
    (the latest when None), hashing in place: (step, the verified chunks as a
    ``PeerIndex``, the source keeping them mapped). No pool or no match: None."""
    step = await resolve_step(transport, job, step)
    record = await transport.read_commit(job, step)
    if rank >= record.world_size:
        return step, None, None
    manifest = await transport.read_manifest(job, step, rank)
    entries = [(e, manifest.chunk_size) for e in manifest.entries]
    try:
        pool = LocalPoolSource.open(job, rank, entries, pool_root)
    except UnsupportedFormat as exc:  # another ckptd's pool: nothing to adopt
        log.warning("%s/%d: %s", job, rank, exc)
        return step, None, None
    if pool is None:
        return step, None, None
    needed = manifest.chunk_ids()
    verified: dict[str, memoryview] = {}

    def check() -> None:
        for cid in needed:
            for holder in pool.holders(cid):
                view = pool.bytes_of(holder)
                if chunk_id(view) == cid:
                    verified[cid] = view
                    break

    await in_thread(check)
    if not serves_whole(job, rank, step, needed, verified):
        pool.close()
        return step, None, None
    log.info("%s/%d: staging pool holds the %d chunks of step %d", job, rank,
             len(needed), step)
    return step, PeerIndex(step=step, chunks=verified, valid=pool.unchanged), pool


class Restorer:
    """Restores of one checkpointer (see ``Checkpointer.restore``)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def check(self, state: Any, tiers: Iterable[str] | None) -> set[str]:
        """The tiers to use; refuses a target that is no mapping or unknown tiers."""
        if not isinstance(state, MutableMapping):
            raise InvalidRequest(f"restore needs a mutable mapping, not {type(state).__name__}")
        if isinstance(tiers, str):
            raise InvalidRequest(f"tiers takes a list of tiers, e.g. tiers=[{tiers!r}], not "
                                 f"the string {tiers!r}")
        use = set(TIERS if tiers is None else tiers)
        unknown = sorted(use - set(TIERS))
        if unknown or not use:
            raise InvalidRequest(f"tiers must be a non-empty subset of {list(TIERS)}, "
                                 f"not {sorted(use)}")
        return use

    def holds_pool(self) -> bool:
        """Whether this node's shared memory holds a staging pool of this rank with a
        step in it (a hint: a restore verifies every chunk)."""
        c = self.session.config
        try:
            reader = StagingPool.open_existing(c.job, c.rank, self.session.staging.root)
        except CkptdError:  # a pool of another version: there is one
            return True
        if reader is None:
            return False
        try:
            return reader.step is not None
        finally:
            reader.close()

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None,
        *,
        use: set[str],
        shards: Mapping[str, Any] | None,
        atomic: bool,
        timeout: float | None,
        exclude_peers: tuple[str, ...],
        strict: bool = True,
        adopt: bool = True,
    ) -> tuple[RestoreResult, Fetched]:
        """Fills ``state`` in place from the tiers in ``use`` (``check`` them first);
        ``Stateful`` objects get their ``load_state_dict()`` once it is filled.
        ``adopt``: keep the pool's verified chunks mapped, to serve them."""
        s, c = self.session, self.session.config
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise InvalidRequest(f"restore's timeout is seconds above 0 (or None: the "
                                 f"checkpointer's), not {timeout!r}")
        timeout = s.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout

        what = (f"the restore of {c.job}'s " + ("latest step" if step is None else f"step {step}")
                + f" (rank {c.rank})")

        def call(coro: Coroutine[Any, Any, T]) -> T:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                # (An error not ckptd's, e.g. a device's, is the restore's failure.)
                return s.call(coro, left, what, RestoreError)
            except Timeout as exc:
                if timeout is None or "after_s" not in exc.detail:
                    raise  # (a peer's or a request's own deadline says what it was)
                # Said of the whole restore, not of the moment left to its last part.
                raise Timeout(f"{what} ran out of its {timeout:g} s timeout; pass a longer "
                              "timeout=",
                              job=c.job, rank=c.rank, timeout_s=timeout) from None

        cache = c.cache_dir if c.cache_dir is not None else knobs.cache_dir()
        opts = RestoreOptions(
            local="local" in use,
            pool_root=s.staging.root,
            cache_dir=cache if "cache" in use else "",
            peers="peer" in use,
            store="store" in use,
            exclude_peers=exclude_peers,
            token=c.token,
            atomic=atomic,
            strict=strict,
            stateful=stateful_kinds(state),
            places=stateful_places(state),
        )
        # Stateful objects (model, optimizer, RNGState) restore through a view that
        # holds their state_dict(); load_state_dict() gets it once it is filled.
        target, load_stateful = restore_view(state, strict=strict)
        # No save stages into the pool while a restore may read it.
        with s.lock:
            s.check_open()
            result, fetched = restore_into(
                call, s.transport, target, job=c.job, rank=c.rank,
                world_size=c.world_size, step=step, shards=shards, opts=opts, adopt=adopt,
            )
        load_stateful()
        return result, fetched

    def adopt(
        self, step: int | None, timeout: float | None
    ) -> tuple[int, PeerIndex, LocalPoolSource] | None:
        """This node's pool checked against a committed step (``adopt_pool``): the
        step, its verified chunks and the source keeping them mapped, or None."""
        s, c = self.session, self.session.config
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise InvalidRequest(f"restore's timeout is seconds above 0 (or None: the "
                                 f"checkpointer's), not {timeout!r}")
        timeout = s.timeout if timeout is None else timeout
        with s.lock:
            try:
                held, index, pool = s.call(
                    adopt_pool(s.transport, c.job, c.rank, step, s.staging.root), timeout)
            except CheckpointNotFound:
                return None
        if index is None or pool is None:
            return None
        return held, index, pool
