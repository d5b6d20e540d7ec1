"""The in-process client: ``Checkpointer.save`` stages and returns at once, a
background pipeline uploads; ``Checkpointer.restore`` fills a state dict in place.

Staging (``staging/``) copies the state into a reusable shared-memory pool;
the save flow (``save/``) hashes, dedups and uploads from that pool. One
snapshot per rank is in flight at a time, so the pool holds one staged copy.

Failover (with a server): the checkpointer serves its pool's committed chunks to
peers (``peer.py``) and heartbeats (``heartbeat.py``); ``restore`` takes each chunk
from the first tier that has it right (``restore/``): this node's pool, a local
cache directory, peers, the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from ckptd import knobs
from ckptd.errors import (
    CheckpointNotFound,
    CkptdError,
    Conflict,
    InvalidRequest,
    SnapshotSkipped,
    Timeout,
    UnsupportedValue,
    ValidationFailed,
)
from ckptd.format import (
    EPOCH_META,
    Placement,
    canonical_json,
    check_job,
    check_rank,
    check_step,
)
from ckptd.knobs import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

from .cuda import CopyDone
from .endpoint import endpoint
from .failures import CloseResult, FailureLog, SnapshotFailureWarning, name_save_error
from .heartbeat import HealthFn, Heartbeat, HeartbeatReply
from .loop import EventLoopThread
from .peer import PeerIndex, PeerServer, PeerService
from .restore.restorer import RestoreOptions, RestoreResult, adopt_pool, restore_into
from .restore.sources import TIERS
from .save.flatten import flatten
from .save.snapshot import SaveResult, Snapshot, SnapshotUpload, wrap_error
from .staging.layout import PAGE, StagedPiece
from .staging.pool import StagingPool
from .stateful import restore_view
from .transport import HttpTransport, Transport, open_transport

if TYPE_CHECKING:
    from ckptd.policy import Policy

    from .health import HealthAgent
    from .probe import ReadingSource

log = logging.getLogger(__name__)

# Pending steps a rank keeps asking about (the oldest first); older ones are let go.
MAX_PENDING_ASKED = 8

T = TypeVar("T")
OnBusy = Literal["wait", "skip"]
OnError = Literal["raise", "warn"]
DefaultPlacement = Literal["replicated", "local"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a rank's tensor sits in a global tensor: this rank holds
    ``global[offsets[0] : offsets[0] + t.shape[0], ...]``."""

    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        g = tuple(int(d) for d in self.global_shape)
        o = tuple(int(d) for d in self.offsets)
        if len(g) != len(o):
            raise InvalidRequest(
                f"Shard: global_shape {list(g)} and offsets {list(o)} differ in rank"
            )
        if any(d < 0 for d in g + o):
            raise InvalidRequest("Shard: negative dimension or offset")
        object.__setattr__(self, "global_shape", g)
        object.__setattr__(self, "offsets", o)


class SaveHandle:
    """A snapshot in flight.

    When the caller may change its tensors again: on the CPU, as soon as ``save()``
    returns (the staging copy is done by then); with CUDA tensors, once ``staged()``
    returned, or, for changes made by kernels on the current stream, once
    ``block_current_stream()`` was called (``save()`` does that by default).
    ``wait()`` gives the result once the step is uploaded, or raises the typed
    error that stopped it.

    ``skipped``: the save was skipped by ``on_busy="skip"`` (nothing staged);
    ``waited_seconds``: how long ``save()`` waited for the snapshot before it
    (``on_busy="wait"``); ``stall_seconds``: how long ``save()`` blocked in all;
    ``pieces``: how many pieces a staging budget split the state into."""

    def __init__(
        self,
        step: int,
        future: concurrent.futures.Future[SaveResult] | None,
        *,
        skipped: bool = False,
        copy_done: CopyDone | None = None,
        stall_seconds: float = 0.0,
        waited_seconds: float = 0.0,
        pieces: int = 1,
        on_failure_seen: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.step = step
        self.skipped = skipped
        self.stall_seconds = stall_seconds
        self.waited_seconds = waited_seconds
        self.pieces = pieces
        self._future = future
        self._copy_done = copy_done
        self._on_failure_seen = on_failure_seen

    def __repr__(self) -> str:
        what = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"<SaveHandle step={self.step} {what}>"

    def done(self) -> bool:
        """True once the snapshot finished (or failed, or was skipped)."""
        return self._future is None or self._future.done()

    @property
    def waited(self) -> bool:
        """True when ``save()`` waited for the snapshot in flight before it."""
        return self.waited_seconds > 0.0

    def staged(self, timeout: float | None = None) -> None:
        """Returns once the training loop may change its tensors again.

        On the CPU the copy is finished when ``save()`` returns, so this returns at
        once. With CUDA tensors the copies run on a side stream: this blocks the
        host until they are done (``Timeout`` after ``timeout`` seconds). Call it
        before changing the tensors, e.g. before ``optimizer.step()``."""
        if self._copy_done is not None:
            self._copy_done.synchronize(timeout)

    def block_current_stream(self) -> None:
        """Makes each device's current CUDA stream wait for the staging copies,
        without blocking the host: kernels queued on it afterwards (an optimizer
        step) run after the copies. Changes made from other streams or from the
        host still need ``staged()``. A no-op on the CPU."""
        if self._copy_done is not None:
            self._copy_done.block_streams()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Waits for the upload and commit; the ``SaveResult``.

        Raises ``SnapshotSkipped`` for a skipped save, ``Timeout`` when ``timeout``
        seconds pass first (the snapshot goes on), or the typed ``CkptdError`` that
        failed the snapshot."""
        if self._future is None:
            raise SnapshotSkipped(
                f"save of step {self.step} was skipped: a snapshot was in flight", step=self.step
            )
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise Timeout(
                f"snapshot of step {self.step} still running after {timeout} s", step=self.step
            ) from None
        except concurrent.futures.CancelledError:
            raise CkptdError(
                f"snapshot of step {self.step} was cancelled", step=self.step
            ) from None
        except CkptdError as exc:
            if self._on_failure_seen is not None:
                self._on_failure_seen(exc)  # seen here: the next save() need not raise it
            raise
        except Exception as exc:
            raise wrap_error(exc, f"snapshot of step {self.step}") from exc


class Checkpointer:
    """Asynchronous, deduplicated, verified checkpoints of one rank's state.

    ``url`` is ``http://host:port`` (a ckptd server) or ``file:///path`` (a local
    directory store, no server). One snapshot per rank is in flight at a time: a
    ``save`` while one is in flight waits for it (``on_busy="wait"``) or is skipped
    (``on_busy="skip"``). Tensors are ``"replicated"`` across ranks by default (the
    server checks that replicas agree and dedups them), ``"local"`` when named in
    ``local`` (rank-private), or ``"sharded"`` when given a ``Shard`` (or when they
    are DTensors, whose placements say where their shard sits). ``timeout`` bounds
    every blocking call that takes no timeout of its own (None: no bound).
    ``url`` and ``token`` default to ``CKPTD_URL`` and ``CKPTD_TOKEN``.

    A snapshot that fails in the background is never silent: it is logged at
    ERROR once (the typed error naming job, step and rank, and what to do), the
    heartbeat reports it (``ckptd status``, the dashboard, ``/metrics``'
    ``ckptd_snapshot_failures_total``), the next ``save()``, ``step()`` or
    ``close()`` raises it (``on_error="raise"``) or warns
    (``on_error="warn"``, a ``SnapshotFailureWarning``; default
    ``CKPTD_ON_ERROR`` or ``"raise"``), and ``close()``'s ``CloseResult``
    counts it.

    Staging goes to a shared-memory pool under ``shm_dir`` (default
    ``CKPTD_SHM_DIR`` or ``/dev/shm``) named by job and rank, which a restarted
    worker can restore from; ``staging_budget`` bounds its bytes (None: one copy of
    the state). A state larger than the budget is staged and uploaded in pieces
    inside ``save()``: the stall grows, memory does not. ``close()`` (or leaving
    the ``with`` block) removes the pool.

    With an ``http://`` server the checkpointer also takes part in failover: it
    serves the chunks of the committed step its pool holds to peers
    (``serve_peers``, default on; ``peer_host`` / ``peer_port``, default
    ``CKPTD_PEER_HOST`` / ``CKPTD_PEER_PORT``, 127.0.0.1 and a port the OS picks;
    the job's ``token`` guards it) and heartbeats to the server every
    ``heartbeat_interval`` seconds (the server's interval once it answered) with
    its peer address, the loop's step (``note_step``), the committed step it
    holds and ``health()`` (default: ok). ``cache_dir`` (default
    ``CKPTD_CACHE_DIR``) is a local directory store that ``restore`` reads before
    peers, e.g. what ``ckptd restore --to DIR`` filled."""

    def __init__(
        self,
        url: str | None = None,
        job: str = "",
        rank: int = 0,
        world_size: int = 1,
        token: str | None = None,
        *,
        chunk_size: int | None = None,
        default_placement: DefaultPlacement = "replicated",
        on_busy: OnBusy = "wait",
        on_error: OnError | None = None,
        timeout: float | None = None,
        staging_budget: int | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        serve_peers: bool | None = None,
        peer_host: str | None = None,
        peer_port: int | None = None,
        heartbeat_interval: float | None = None,
        health: HealthFn | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        health_policy: Policy | str | os.PathLike[str] | None = None,
        health_sources: Iterable[ReadingSource] | None = None,
    ) -> None:
        url, token = endpoint(url, token)
        self.url = url
        self.job = check_job(job)
        self.world_size = world_size
        self.rank = check_rank(rank, world_size, job=self.job)
        self.chunk_size = knobs.chunk_size() if chunk_size is None else int(chunk_size)
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidRequest(
                f"chunk_size {self.chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
            )
        if default_placement not in ("replicated", "local"):
            raise InvalidRequest(
                f"default_placement must be 'replicated' or 'local', not {default_placement!r}"
            )
        if on_busy not in ("wait", "skip"):
            raise InvalidRequest(f"on_busy must be 'wait' or 'skip', not {on_busy!r}")
        if on_error is None:
            on_error = "warn" if os.environ.get("CKPTD_ON_ERROR") == "warn" else "raise"
        if on_error not in ("raise", "warn"):
            raise InvalidRequest(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        self.on_error: OnError = on_error
        self._failures = FailureLog(self.job, self.rank)
        # Steps this rank uploaded whose commit was pending (other ranks to come),
        # oldest first, with their meta, and the background question whether the
        # oldest committed: a step that can never commit (replicas disagree) fails
        # on the rank whose manifest came last, and every other rank learns it by
        # asking again; a later pending step must not make it forget an earlier one.
        self._pending_commits: dict[int, dict[str, Any]] = {}
        self._pending_lock = threading.Lock()
        self._pending_check: concurrent.futures.Future[Any] | None = None
        self._pending_asked = 0.0
        if staging_budget is not None and staging_budget < self.chunk_size + PAGE:
            raise InvalidRequest(
                f"staging_budget {staging_budget} cannot hold one chunk of {self.chunk_size} "
                f"bytes; it needs at least {self.chunk_size + PAGE}"
            )
        self.default_placement: DefaultPlacement = default_placement
        self.on_busy: OnBusy = on_busy
        self.timeout = timeout
        self._transport = open_transport(url, token, job=self.job)
        try:
            self._staging = StagingPool(self.job, self.rank, root=shm_dir, budget=staging_budget)
        except BaseException:
            asyncio.run(self._transport.close())
            raise
        self._loop = EventLoopThread(f"ckptd-{job}-{rank}")
        # The job's timeline this rank is in (how many rollbacks the job had when
        # it started or last restored), stamped on every manifest: saves of a
        # timeline a rollback ended are refused. Asked for now, in the background.
        self._epoch: int | None = None
        self._epoch_lock = threading.Lock()
        self._epoch_call = self._loop.submit(self._transport.epoch(self.job))
        # The future of the last snapshot's work that reads the staging pool: the
        # pool is overwritten only once it is done.
        self._inflight: concurrent.futures.Future[Any] | None = None
        self._inflight_step: int | None = None  # the step _inflight uploads
        self._lock = threading.Lock()
        self._closed = False
        self._token = token
        self.cache_dir = cache_dir
        # The health agent (probe, coordinated snapshots, rollback) starts with the
        # first step() call, so checkpointers that never report steps run no probe.
        self._health_policy = health_policy
        self._health_sources = health_sources
        self._health: HealthAgent | None = None
        try:
            self._service = self._start_service(serve_peers, peer_host, peer_port,
                                                heartbeat_interval, health)
        except BaseException:
            self._loop.run(self._transport.close(), 10.0)
            self._loop.stop()
            self._staging.close()
            raise

    def _start_service(
        self,
        serve_peers: bool | None,
        host: str | None,
        port: int | None,
        interval: float | None,
        health: HealthFn | None,
    ) -> PeerService:
        """The peer server and heartbeats: with an HTTP server only (a ``file://``
        store has nobody to register with, so peers could not find this one)."""
        if not isinstance(self._transport, HttpTransport):
            return PeerService(None, None)
        server = None
        if serve_peers is None or serve_peers:
            # No token yet: the job's peer token comes with the first heartbeat reply.
            server = PeerServer(host=host, port=port, job=self.job, rank=self.rank,
                                route_to=self._transport.url).start()
        heartbeat = Heartbeat(self._transport.url, self.job, self.rank, self.world_size,
                              self._token, interval=interval, health=health)
        service = PeerService(server, heartbeat)
        service.start()
        return service

    @property
    def transport(self) -> Transport:
        """The transport (it lives on this checkpointer's background loop)."""
        return self._transport

    @property
    def staging(self) -> StagingPool:
        """The staging pool (its ``stats`` count what it allocated)."""
        return self._staging

    @property
    def peer_server(self) -> PeerServer | None:
        """The peer chunk server (None with a ``file://`` store or ``serve_peers=False``)."""
        return self._service.server

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The heartbeat sender (None with a ``file://`` store)."""
        return self._service.heartbeat

    @property
    def last_heartbeat_reply(self) -> HeartbeatReply | None:
        """The server's last answer to a heartbeat (``snapshot_at``, ``rollback_to``)."""
        hb = self._service.heartbeat
        return hb.last_reply if hb is not None else None

    def note_step(self, step: int) -> None:
        """Tells heartbeats the training loop's current step (``save`` does too)."""
        self._service.note_step(step)

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self._transport.describe()!r}, job={self.job!r}, "
            f"rank={self.rank}, world_size={self.world_size})"
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:  # the block's own error wins; a failed save is logged already
            self._close()
        else:
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("this Checkpointer is closed")

    # -- save -----------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[Any, Any],
        *,
        shards: Mapping[str, Shard] | None = None,
        local: Iterable[str] = (),
        meta: dict[str, Any] | None = None,
        block_training: bool = True,
        tag: str | None = None,
    ) -> SaveHandle:
        """Stages a copy of ``state`` and returns; the upload runs in the background.

        ``state`` is a nested mapping of tensors and plain values (what
        ``state_dict()`` methods return); tensors are named by their keys joined
        with ".". ``shards`` maps such names to their ``Shard`` of a global tensor;
        names in ``local`` are rank-private (both override what a DTensor's
        placements say); ``meta`` (JSON) goes into this rank's manifest and is
        offered to the commit record. ``tag`` names the step once it commits
        (``ckptd tag``): retention keeps tagged steps.

        When the caller may change its tensors again: CPU tensors as soon as this
        returns (the copy is done). CUDA tensors are copied on a side stream that
        first waits for the work already queued on the current stream; this
        returns once the copies are queued. By default (``block_training=True``)
        kernels queued later on the current stream wait for the copies on the GPU,
        with no host stall, so an optimizer step queued there cannot change a
        tensor before it is copied: the training stream stalls only for the copy.
        With ``block_training=False`` the current stream runs on while the copies
        proceed, and the caller must not change the tensors before
        ``handle.staged()`` returned (or ``handle.block_current_stream()`` was
        called); passes that only read them may overlap the copy.

        A snapshot already in flight is waited for (``on_busy="wait"``, at most
        ``timeout`` seconds, then ``Timeout``) or this save is skipped
        (``on_busy="skip"``: ``handle.skipped``). Raises at once for a state that
        cannot be stored (``UnsupportedValue``, naming the path); errors of the
        upload come out of ``SaveHandle.wait()``, and out of the next ``save()``,
        ``step()`` or ``close()`` (see ``on_error``). Objects with ``state_dict()``
        and ``load_state_dict()`` (a module, optimizer, scheduler, ``RNGState``) are
        saved as their ``state_dict()``; raw ``bytes`` as opaque verified blobs."""
        started = time.perf_counter()
        self._check_open()
        self._surface_failure()
        self._ask_pending()
        check_step(step)
        self._service.note_step(step)
        flat = flatten(state)
        layouts: Mapping[str, tuple[Placement, list[int], list[int]]] = (
            getattr(flat, "layouts", None) or {}
        )
        # Rank-private Stateful objects (RNGState) are local unless named otherwise.
        local = list(local)
        explicit = set(shards or {}) | set(local)
        local += sorted(getattr(flat, "local", set()) - explicit)
        placements = self._placements(flat.tensors, shards or {}, local, layouts)
        meta = dict(meta or {})
        if tag is not None:
            meta["tag"] = tag  # the commit tags the step (ckptd.lifecycle.tags.TAG_META)
        if EPOCH_META in meta:
            raise UnsupportedValue(f"meta key {EPOCH_META!r} is ckptd's (the job's timeline)")
        try:
            canonical_json(meta)
        except (TypeError, ValueError) as exc:
            raise UnsupportedValue(f"meta is not plain JSON: {exc}") from None
        # Never waits: an epoch not known yet is awaited by the upload, off this thread.
        epoch, pending = self._timeline()
        if epoch:
            meta[EPOCH_META] = epoch
        with self._lock:
            self._check_open()
            waited = 0.0
            busy = self._inflight
            if busy is not None and not busy.done():
                if self.on_busy == "skip":
                    log.info("%s/%d: step %d skipped, a snapshot is in flight",
                             self.job, self.rank, step)
                    self._failures.skipped += 1
                    return SaveHandle(step, None, skipped=True,
                                      stall_seconds=time.perf_counter() - started)
                t_wait = time.perf_counter()
                concurrent.futures.wait([busy], self.timeout)
                waited = time.perf_counter() - t_wait
                if not busy.done():
                    raise Timeout(
                        f"save of step {step}: the snapshot in flight did not finish "
                        f"within {self.timeout} s",
                        step=step,
                    )
                # The snapshot waited for may have failed just now; its done-callback
                # may not have run yet. Record it (once per step) and surface it here,
                # before a new snapshot is staged past it.
                failed = None if busy.cancelled() else busy.exception()
                if failed is not None and self._inflight_step is not None:
                    self._snapshot_failed(self._inflight_step, failed)
                self._surface_failure()
            future, copy_done, pieces = self._stage_and_submit(step, flat.tree, flat.tensors,
                                                               placements, meta, started,
                                                               pending)
            self._failures.saves += 1
        future.add_done_callback(functools.partial(self._snapshot_done, step=step, meta=meta))
        if block_training and copy_done is not None:
            copy_done.block_streams()
        stall = time.perf_counter() - started
        log.debug("%s/%d: step %d staged in %d piece(s), save() took %.4f s",
                  self.job, self.rank, step, pieces, stall)
        return SaveHandle(step, future, copy_done=copy_done, stall_seconds=stall,
                          waited_seconds=waited, pieces=pieces,
                          on_failure_seen=self._failures.seen)

    def _stage_and_submit(
        self,
        step: int,
        tree: dict[str, Any],
        tensors: list[tuple[str, torch.Tensor]],
        placements: dict[str, tuple[Placement, list[int], list[int]]],
        meta: dict[str, Any],
        started: float,
        epoch_pending: concurrent.futures.Future[int] | None = None,
    ) -> tuple[concurrent.futures.Future[SaveResult], CopyDone | None, int]:
        """Stages the state piece by piece and hands each to the pipeline; every
        piece but the last is uploaded before the next overwrites the pool. Runs
        under ``self._lock`` with no snapshot in flight."""
        plan = self._staging.prepare(tensors, self.chunk_size)
        snap = Snapshot(
            job=self.job,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            chunk_size=self.chunk_size,
            tree=tree,
            tensors=plan.infos,
            placements=placements,
            meta=meta,
            started=started,
            epoch_pending=epoch_pending,
        )
        upload = SnapshotUpload(self._transport, snap, plan.piece_count)
        self._service.staging()  # what peers were served is about to be overwritten
        for number in range(plan.piece_count):
            piece = self._staging.stage(plan, number, step)
            if piece.last:
                future = self._loop.submit(self._named(upload.finish(piece), step))
                future.add_done_callback(functools.partial(self._uploaded, upload=upload,
                                                           piece=piece))
                self._inflight, self._inflight_step = future, step
                return future, piece.copy_done, plan.piece_count
            sent = self._loop.submit(upload.send(piece))
            # It reads the pool: nothing may overwrite the pool before it is sent.
            self._inflight, self._inflight_step = sent, step
            done, _ = concurrent.futures.wait([sent], self.timeout)
            if not done:
                return _failed(self._name(Timeout(
                    f"piece {number + 1} of {plan.piece_count} was not "
                    f"uploaded within {self.timeout} s; the snapshot is abandoned",
                    step=step,
                ), step)), None, plan.piece_count
            exc = sent.exception()
            if exc is not None:
                return _failed(self._name(exc, step)), None, plan.piece_count
        raise AssertionError("a staging plan has at least one piece")

    def _name(self, exc: BaseException, step: int) -> CkptdError:
        return name_save_error(exc, self.job, step, self.rank)

    async def _named(self, work: Coroutine[Any, Any, T], step: int) -> T:
        """``work``, its error typed and naming this save (job, step, rank) before
        anyone waiting on the snapshot sees it."""
        try:
            return await work
        except Exception as exc:
            err = self._name(exc, step)
            if err is exc:
                raise
            raise err from exc

    def _snapshot_done(
        self, future: concurrent.futures.Future[SaveResult], *, step: int,
        meta: dict[str, Any],
    ) -> None:
        """A snapshot finished: a failure is recorded (logged, held for the loop,
        sent in heartbeats); a pending commit is remembered, to be asked about."""
        if future.cancelled():
            self._snapshot_failed(step, CkptdError("the snapshot was cancelled"))
            return
        exc = future.exception()
        if exc is not None:
            self._snapshot_failed(step, exc)
            return
        with self._pending_lock:
            if future.result().state == "pending":
                self._pending_commits[step] = meta
                while len(self._pending_commits) > MAX_PENDING_ASKED:
                    del self._pending_commits[next(iter(self._pending_commits))]
            else:  # committed: what was pending before it no longer matters
                for older in [s for s in self._pending_commits if s <= step]:
                    del self._pending_commits[older]

    def _snapshot_failed(self, step: int, exc: BaseException) -> None:
        err = self._failures.record(step, exc)
        hb = self._service.heartbeat
        if err is not None and hb is not None:
            hb.note_snapshot_failure(str(err))

    def _ask_pending(self, timeout: float | None = None) -> None:
        """Asks, in the background (at most twice a second), whether the oldest step
        that was pending here committed; a step that cannot commit is recorded as
        this rank's failure too. With ``timeout`` (closing), asks about every
        pending step and waits up to that long for each answer."""
        with self._pending_lock:
            pending = list(self._pending_commits.items())
        if not pending:
            return
        if timeout is None:
            check = self._pending_check
            if (check is not None and not check.done()) or (
                time.monotonic() - self._pending_asked < 0.5
            ):
                return
            pending = pending[:1]
        deadline = None if timeout is None else time.monotonic() + timeout
        for step, meta in pending:
            self._pending_asked = time.monotonic()
            check = self._loop.submit(self._transport.commit(self.job, step, meta or None))
            check.add_done_callback(functools.partial(self._pending_answer, step=step))
            self._pending_check = check
            if deadline is not None:  # all the questions together, within ``timeout``
                left = deadline - time.monotonic()
                if left <= 0 or not concurrent.futures.wait([check], left).done:
                    break

    def _pending_answer(self, future: concurrent.futures.Future[Any], *, step: int) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            if future.result().state == "committed":
                with self._pending_lock:
                    self._pending_commits.pop(step, None)
            return
        if isinstance(exc, ValidationFailed | Conflict):  # never commits: a failure
            with self._pending_lock:
                self._pending_commits.pop(step, None)
            self._snapshot_failed(step, exc)
        else:  # the server may be back next time
            log.debug("%s/%d: cannot ask whether step %d committed: %s", self.job, self.rank,
                      step, exc)

    def _surface_failure(self) -> None:
        """Raises (or warns of) a failed snapshot the loop has not seen yet."""
        err = self._failures.take()
        if err is None:
            return
        if self.on_error == "raise":
            raise err
        warnings.warn(str(err), SnapshotFailureWarning, stacklevel=3)

    def _uploaded(
        self,
        future: concurrent.futures.Future[SaveResult],
        *,
        upload: SnapshotUpload,
        piece: StagedPiece,
    ) -> None:
        """Once a snapshot is in: its last piece is what the pool holds; serve it to
        peers when the step is committed, while the pool still holds it."""
        if future.cancelled() or future.exception() is not None or self._closed:
            return
        result = future.result()
        pool, generation = self._staging, piece.generation
        index = PeerIndex(step=result.step, chunks=upload.chunks_of(piece),
                          valid=lambda: pool.generation == generation)
        try:
            if result.state == "committed":
                self._service.committed(index)
            else:
                self._service.pending(index)
        except Exception as exc:  # serving peers is best effort; the save succeeded
            log.warning("%s/%d: cannot serve step %d to peers: %s", self.job, self.rank,
                        result.step, exc)

    def _placements(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        shards: Mapping[str, Shard],
        local: Iterable[str],
        layouts: Mapping[str, tuple[Placement, list[int], list[int]]] | None = None,
    ) -> dict[str, tuple[Placement, list[int], list[int]]]:
        """Each tensor's (placement, global shape, offsets): an explicit ``shards``
        or ``local`` entry wins, then the layout a DTensor's placements gave
        (``layouts``, from ``flatten``), then ``default_placement``."""
        layouts = layouts or {}
        by_name = dict(tensors)
        local_names = set(local)
        unknown = sorted((set(shards) | local_names) - by_name.keys())
        if unknown:
            raise InvalidRequest(
                f"shards or local name tensors the state does not hold: {unknown[:10]}",
                names=unknown[:50],
            )
        both = sorted(set(shards) & local_names)
        if both:
            raise InvalidRequest(f"tensors both sharded and local: {both[:10]}", names=both[:50])
        out: dict[str, tuple[Placement, list[int], list[int]]] = {}
        for name, tensor in tensors:
            shape = [int(d) for d in tensor.shape]
            shard = shards.get(name)
            if shard is not None:
                g, o = list(shard.global_shape), list(shard.offsets)
                if len(g) != len(shape) or any(
                    a + s > d for a, s, d in zip(o, shape, g, strict=True)
                ):
                    raise InvalidRequest(
                        f"shard of {name!r} with shape {shape} at offsets {o} does not fit "
                        f"in global shape {g}",
                        name=name,
                    )
                out[name] = ("sharded", g, o)
            elif name in local_names:
                out[name] = ("local", shape, [0] * len(shape))
            elif name in layouts:
                placement, g, o = layouts[name]
                g, o = [int(d) for d in g], [int(d) for d in o]
                if len(g) != len(shape) or len(o) != len(shape) or any(
                    a < 0 or a + s > d for a, s, d in zip(o, shape, g, strict=True)
                ):
                    raise InvalidRequest(
                        f"the layout of {name!r} (global shape {g}, offsets {o}) does not "
                        f"fit its local shape {shape}",
                        name=name,
                    )
                out[name] = (placement, g, o)
            else:
                out[name] = (self.default_placement, shape, [0] * len(shape))
        return out

    # -- restore and queries ----------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None = None,
        *,
        shards: Mapping[str, Shard] | None = None,
        tiers: Iterable[str] | None = None,
        atomic: bool = True,
        timeout: float | None = None,
    ) -> RestoreResult:
        """Fills ``state`` in place with this rank's tensors and values of a
        committed step (the latest when ``step`` is None), bitwise.

        Each chunk comes from the first tier that has it right: this node's
        staging pool (what a crashed worker left in shared memory), the local
        cache directory, live peers (in parallel), the store; ``tiers`` limits
        them (names from ``TIERS``). Every chunk is hashed on arrival; a bad or
        missing one is taken from the next source and reported in
        ``RestoreResult.problems``; ``bytes_from`` says how many bytes each tier
        gave.

        Tensors the target holds with the checkpoint's dtype and shape are
        overwritten in place (so ``model.state_dict()`` restores the model);
        missing ones (a fresh optimizer's empty ``state``) are created; plain values
        are set. Where the target needs another box of a global tensor than this
        rank saved (another world size: ``shards`` gives the new ``Shard`` of a
        tensor, or the target holds a DTensor, or a plain tensor of the global
        shape), the box is cut from the chunks of every rank that overlap it.
        Every chunk is verified before anything in ``state`` changes: a restore
        either fills all of it or raises (``CheckpointNotFound``, ``NotCommitted``
        for a step that never committed, ``ChunkHashMismatch``, ``RestoreError``
        naming the entries and chunk ids no source had) and leaves it as it was.
        That takes memory for every chunk fetched from peers or the store until
        the end. ``atomic=False`` writes those straight into the target's own
        tensors as each verifies (no extra memory, one copy less); then a chunk
        no source has leaves the target partly restored (the error's detail says
        ``partial``). The bytes restored are the committed ones either way.

        Objects with ``state_dict()`` and ``load_state_dict()`` (a module, an
        optimizer, a scheduler, ``RNGState``) are restored through their
        ``state_dict()`` and get it back by ``load_state_dict()``. The result's
        ``step`` is the step restored: ``start = ckpt.restore(state).step + 1``.

        The pool's chunks that verified are then served to peers (with a server)."""
        self._check_open()
        if not isinstance(state, MutableMapping):
            raise InvalidRequest(f"restore needs a mutable mapping, not {type(state).__name__}")
        use = set(TIERS if tiers is None else tiers)
        unknown = sorted(use - set(TIERS))
        if unknown or not use:
            raise InvalidRequest(f"tiers must be a non-empty subset of {list(TIERS)}, "
                                 f"not {sorted(use)}")
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout

        def call(coro: Coroutine[Any, Any, T]) -> T:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._call(coro, left)

        cache = self.cache_dir if self.cache_dir is not None else knobs.cache_dir()
        opts = RestoreOptions(
            local="local" in use,
            pool_root=self._staging.root,
            cache_dir=cache if "cache" in use else "",
            peers="peer" in use,
            store="store" in use,
            exclude_peers=tuple(u for u in (self._service.url,) if u),
            token=self._token,
            atomic=atomic,
        )
        before = self._rollback_state()
        # Stateful objects (model, optimizer, RNGState) restore through a view that
        # holds their state_dict(); load_state_dict() gets it once it is filled.
        target, load_stateful = restore_view(state)
        # No save stages into the pool while a restore may read it.
        with self._lock:
            self._check_open()
            result, fetched = restore_into(
                call, self._transport, target, job=self.job, rank=self.rank,
                world_size=self.world_size, step=step, shards=shards, opts=opts,
            )
        load_stateful()
        if fetched.adopted is not None and fetched.pool is not None:
            if self._service.server is not None:
                self._service.adopted(fetched.adopted, fetched.pool, beat=False)
            else:
                fetched.pool.close()
        self._join_timeline(result.step, before)
        if self._health is not None:
            self._health.acknowledge_rollback(result.step)
        return result

    @property
    def epoch(self) -> int | None:
        """The job's timeline this rank saves in (how many rollbacks the job had when
        this checkpointer started or last restored), or None while not known."""
        return self._timeline()[0]

    def _timeline(self) -> tuple[int | None, concurrent.futures.Future[int] | None]:
        """(the epoch this rank saves in, or None and the question still out). A
        question that failed is asked again (the server may be back)."""
        with self._epoch_lock:
            if self._epoch is not None:
                return self._epoch, None
            call = self._epoch_call
            if not call.done():
                return None, call
            try:
                self._epoch = call.result()
            except Exception as exc:
                log.warning("%s/%d: cannot learn the job's timeline: %s", self.job, self.rank,
                            exc)
                self._epoch_call = self._loop.submit(self._transport.epoch(self.job))
                return None, self._epoch_call
            return self._epoch, None

    def _rollback_state(self) -> tuple[int | None, int] | None:
        try:
            return self._loop.run(self._transport.rollback_state(self.job), self.timeout)
        except Exception as exc:
            log.warning("%s/%d: cannot read the job's rollback state: %s", self.job, self.rank,
                        exc)
            return None

    def _join_timeline(self, step: int, before: tuple[int | None, int] | None) -> None:
        """After restoring committed ``step``, this rank's saves belong to the job's
        current timeline, if that step is on it: the job is not marked for a
        rollback elsewhere, or is marked for this step, or the step was committed
        in the current timeline; and no rollback began while it restored. Otherwise
        the rank keeps its epoch, and its saves stay refused until it restores the
        rollback's step."""
        after = self._rollback_state()
        if after is None:
            return
        marker, epoch = after
        if before is not None and before[1] != epoch:
            log.warning("%s/%d: a rollback began while step %d was restored; saves stay "
                        "refused until the rollback's step is restored", self.job, self.rank,
                        step)
            return
        joins = marker is None or marker == step
        if not joins:
            try:
                record = self._loop.run(self._transport.read_commit(self.job, step),
                                        self.timeout)
                joins = record.meta.get(EPOCH_META, 0) == epoch
            except Exception as exc:
                log.warning("%s/%d: cannot read the commit record of step %d: %s",
                            self.job, self.rank, step, exc)
        if not joins:
            log.warning("%s/%d: step %d is not on the job's current timeline (it is marked "
                        "for rollback to step %d); saves stay refused until that step is "
                        "restored", self.job, self.rank, step, marker)
            return
        with self._epoch_lock:
            self._epoch = epoch

    # -- the training loop's health ---------------------------------------------------

    def step(
        self,
        step: int,
        loss: float | None = None,
        state: Mapping[Any, Any] | None = None,
        **save_kwargs: Any,
    ) -> SaveHandle | None:
        """Reports that the loop finished ``step`` (with its loss) to the health probe.

        Saves ``state`` and returns the handle when a coordinated snapshot is due
        at this step (asked for by a degraded rank of the job; the commit records
        the reason); returns None otherwise. Raises ``RollbackRequested`` (once per
        rollback) when this rank's loss went non-finite or the job was marked for
        rollback: restore ``e.rollback_to`` and carry on. A poisoned step is never
        snapshotted. A failed earlier snapshot comes out here (see ``on_error``)."""
        self._check_open()
        self._surface_failure()
        self._ask_pending()
        agent = self._health_agent()
        self._service.note_step(step)
        decision = agent.step(step, loss)
        if not decision.snapshot:
            return None
        if state is None:
            log.warning("%s/%d: coordinated snapshot due at step %d, but step() got no state",
                        self.job, self.rank, step)
            return None
        return self.save(step, state, meta=decision.meta, **save_kwargs)

    @property
    def rollback_to(self) -> int | None:
        """The committed step the job must go back to (not yet acted on), or None."""
        return self._health_agent().rollback_to

    def acknowledge_rollback(self, step: int) -> None:
        """The loop restored ``step`` by other means than ``restore()``."""
        self._join_timeline(step, None)
        self._health_agent().acknowledge_rollback(step)

    def _health_agent(self) -> HealthAgent:
        with self._lock:
            if self._health is None:
                from .health import HealthAgent

                self._health = HealthAgent(
                    self.url, self.job, self.rank, self.world_size, self._token,
                    policy=self._health_policy, sources=self._health_sources,
                    heartbeat=self._service.heartbeat, latest=self.latest,
                    epoch=lambda: self.epoch,
                    disk_paths=[str(self._staging.root), *([self.cache_dir] if self.cache_dir
                                                           else [])],
                    timeout=self.timeout or 10.0,
                ).start()
            return self._health

    def adopt(self, step: int | None = None, *, timeout: float | None = None) -> int | None:
        """Re-adopts this node's staging pool: checks each chunk it holds against
        this rank's manifest of a committed step (the latest when None), serves the
        ones that match to peers and says so in a heartbeat sent now. Returns that
        step, or None when the pool holds none of its chunks (or there is no pool,
        or no commit). ``restore`` does this by itself; calling it first on every
        rank (then a barrier) lets a rank that lost its node find its peers."""
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            try:
                held, index, pool = self._call(
                    adopt_pool(self._transport, self.job, self.rank, step, self._staging.root),
                    timeout,
                )
            except CheckpointNotFound:
                return None
        if index is None or pool is None:
            return None
        if self._service.server is not None:
            self._service.adopted(index, pool, beat=True)
        else:
            pool.close()
        return held

    def latest(self) -> int | None:
        """The newest committed step of this job, or None."""
        self._check_open()
        return self._call(self._transport.latest(self.job), self.timeout)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Runs ``coro`` on the background loop; errors come out typed."""
        try:
            return self._loop.run(coro, timeout)
        except CkptdError:
            raise
        except Exception as exc:
            raise wrap_error(exc, "request") from exc

    # -- lifecycle ----------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> CloseResult:
        """Waits for the snapshot in flight, then closes the transport and the
        background loop and removes the staging pool from shared memory.

        Returns how many saves were staged, failed and skipped; then raises a
        failed snapshot's error the loop has not seen (``on_error="raise"``) or
        warns of it. Idempotent."""
        result = self._close(timeout)
        self._surface_failure()
        return result

    def _close(self, timeout: float | None = None) -> CloseResult:
        with self._lock:
            if self._closed:
                return self._failures.result()
            self._closed = True
            busy = self._inflight
        timeout = self.timeout if timeout is None else timeout
        if busy is not None:
            done, _ = concurrent.futures.wait([busy], timeout)
            if not done:
                log.warning("%s/%d: closing with the snapshot of a save still in flight",
                            self.job, self.rank)
        try:  # a step that can never commit is this rank's failure too
            self._ask_pending(timeout=min(timeout, 10.0) if timeout is not None else 10.0)
        except Exception as exc:  # closing must not fail on a question
            log.debug("%s/%d: cannot ask about the pending step: %s", self.job, self.rank, exc)
        hb = self._service.heartbeat
        if hb is not None and self._failures.failed:
            hb.beat_now()  # the last word on this rank's failures, before it goes
        if self._health is not None:
            try:
                self._health.close()
            except Exception as exc:  # closing must not fail the caller's shutdown
                log.warning("%s/%d: stopping the health probe failed: %s",
                            self.job, self.rank, exc)
        try:
            self._service.close()
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("%s/%d: stopping heartbeats and the peer server failed: %s",
                        self.job, self.rank, exc)
        try:
            self._loop.run(self._transport.close(), 10.0)
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("%s/%d: closing the transport failed: %s", self.job, self.rank, exc)
        self._loop.stop()
        self._staging.close()
        return self._failures.result()


def _failed(exc: BaseException) -> concurrent.futures.Future[SaveResult]:
    future: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
    future.set_exception(exc)
    return future
