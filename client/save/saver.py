"""The save flow for one checkpointer (``Saver``): flatten the state, place its
tensors, stage it into the pool piece by piece, hand each piece to the upload on
the background loop; one snapshot in flight at a time; failed snapshots recorded
and surfaced; pending commits asked about until they commit or never can."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ckptd.errors import (
    CkptdError,
    Conflict,
    InvalidRequest,
    Timeout,
    UnsupportedValue,
    ValidationFailed,
)
from ckptd.format import (
    EPOCH_META,
    INCARNATION_META,
    Placement,
    RankManifest,
    canonical_json,
    check_step,
)
from ckptd.lifecycle.tags import TAG_META, check_new_tag

from ..cuda import CopyDone
from ..failures import FailureLog, SnapshotFailureWarning, name_save_error
from ..peer import PeerIndex
from ..session import Session
from ..staging.layout import StagedPiece
from ..timeline import Timeline
from .flatten import flatten
from .group_jobs import GroupJobs
from .handle import SaveHandle
from .placement import Shard
from .placement import placements as place
from .snapshot import SaveResult, Snapshot, SnapshotUpload

if TYPE_CHECKING:
    from ..failover import FailoverAgent

log = logging.getLogger("ckptd.client.checkpointer")

# Pending steps a rank keeps asking about (the oldest first); older ones are let go.
MAX_PENDING_ASKED = 8

T = TypeVar("T")


class Saver:
    """Saves of one checkpointer (see ``Checkpointer.save``)."""

    def __init__(self, session: Session, timeline: Timeline, failover: FailoverAgent) -> None:
        self.session = session
        self.config = session.config
        self.timeline = timeline
        self.failover = failover
        self.failures = FailureLog(self.config.job, self.config.rank, self.config.on_error)
        self._said_read_only = False  # (a read-only token's skipped saves: said once)
        self.group_jobs = GroupJobs(self.config.job, self.config.rank, self.config.world_size)
        # Steps this rank uploaded whose commit was pending (other ranks to come),
        # oldest first, with their meta, and the background question whether the
        # oldest committed: a step that can never commit (replicas disagree) fails
        # on the rank whose manifest came last, and every other rank learns it by
        # asking again; a later pending step must not make it forget an earlier one.
        # Each with the serial of the snapshot that put its manifest.
        self._pending_commits: dict[int, tuple[int, dict[str, Any]]] = {}
        self._pending_lock = threading.Lock()
        self._pending_check: concurrent.futures.Future[Any] | None = None
        self._pending_asked = 0.0
        self._ask_newest = False  # which end of the pending steps the next ask takes
        # The future of the last snapshot's work that reads the staging pool: the
        # pool is overwritten only once it is done.
        self._inflight: concurrent.futures.Future[Any] | None = None
        self._inflight_step: int | None = None  # the step _inflight uploads
        self._inflight_serial = 0  # and the serial of its snapshot
        # Each save's serial: a failure is recorded once per snapshot (FailureLog).
        self._serials = itertools.count(1)
        # Set once the last snapshot's done-callback ran: its future is done before
        # its callbacks run, and close() must not report before they did.
        self._settled: threading.Event | None = None
        # This checkpointer's latest saves, by step: the handle of each, and the
        # manifest each stored (and whether a coordinated snapshot was one of the
        # saves). A coordinated snapshot due at a step the loop saved is that save; a
        # save of a step saved before with the same bytes is one save
        # (``snapshot.same_save``); with other bytes the first stands, and the second
        # is a ``Conflict`` only when the loop made both.
        self._handles: dict[int, SaveHandle] = {}
        self._manifests: dict[int, tuple[RankManifest, bool]] = {}
        self._saves_lock = threading.Lock()

    @property
    def inflight(self) -> concurrent.futures.Future[Any] | None:
        """The work of the last snapshot that may still read the pool."""
        return self._inflight

    def save(self, step: int, state: Mapping[Any, Any], **options: Any) -> SaveHandle:
        """``_save``, its time left out of the loop's step time: it is ckptd's (a copy,
        or the last save's upload to a slow store), not the node's, and a slow store
        must not read as a slow node that asks for one more snapshot."""
        started = time.monotonic()
        try:
            return self._save(step, state, **options)
        finally:
            self.failover.loop_waited(time.monotonic() - started)

    def _save(
        self,
        step: int,
        state: Mapping[Any, Any],
        *,
        shards: Mapping[str, Shard] | None = None,
        local: Iterable[str] | None = (),
        meta: dict[str, Any] | None = None,
        block_training: bool = True,
        tag: str | None = None,
        coordinated: bool = False,
    ) -> SaveHandle:
        """Stages ``state`` and hands it to the upload (``Checkpointer.save``;
        ``coordinated``: a snapshot the health probe asked for, ``Checkpointer.step``,
        as is a save whose ``meta`` says ``"reason": "health"``, a ``StepDecision``'s)."""
        started = time.perf_counter()
        self.session.check_open()
        self.group_jobs.saving(self.config.incarnation)  # (every rank of a launch: one job)
        if self.session.read_only is not None and (coordinated
                                                   or self.config.on_error == "warn"):
            # A read-only token (an eval job's): a snapshot the probe asked for in
            # step(), or any save under on_error="warn", is skipped, said once; training
            # goes on. A save() under "raise" is refused now (check_may_write).
            if not self._said_read_only:
                self._said_read_only = True
                log.warning("%s/%d: save of step %d skipped: this Checkpointer's token may "
                            "only read the job, so its saves are skipped (said once)",
                            self.config.job, self.config.rank, step)
            return SaveHandle(step, None, skipped=True)
        self.session.check_may_write(step)  # a read-only token: refused now, not uploaded
        self.surface_failure(stacklevel=4)
        self.ask_pending()
        check_step(step)
        shards, local, meta = _save_args(shards, local, meta, tag)
        coordinated = coordinated or meta.get("reason") == "health"
        self.failover.note_step(step)
        flat = flatten(state)
        layouts: Mapping[str, tuple[Placement, list[int], list[int]]] = (
            getattr(flat, "layouts", None) or {}
        )
        # Rank-private Stateful objects (RNGState) are local unless named otherwise.
        explicit = set(shards) | set(local)
        local += sorted(getattr(flat, "local", set()) - explicit)
        placements = place(flat.tensors, shards, local, layouts,
                           self.config.default_placement)
        if EPOCH_META in meta:
            raise UnsupportedValue(f"meta key {EPOCH_META!r} is ckptd's (the job's timeline)")
        if INCARNATION_META in meta:
            raise UnsupportedValue(f"meta key {INCARNATION_META!r} is ckptd's (the launch; "
                                   "pass Checkpointer(..., incarnation=))")
        try:
            canonical_json(meta)
        except (TypeError, ValueError) as exc:
            raise UnsupportedValue(f"meta is not plain JSON: {exc}") from None
        # Never waits: an epoch not known yet is awaited by the upload, off this thread.
        epoch, pending = self.timeline.current()
        if epoch:
            meta[EPOCH_META] = epoch
        if self.config.incarnation is not None:  # the commit call names it too
            meta[INCARNATION_META] = self.config.incarnation
        with self.session.lock:
            self.session.check_open()
            waited = 0.0
            busy = self._inflight
            if busy is not None and not busy.done():
                if self.config.on_busy == "skip":
                    log.info("%s/%d: step %d skipped, a snapshot is in flight",
                             self.config.job, self.config.rank, step)
                    self.failures.skipped += 1
                    return SaveHandle(step, None, skipped=True,
                                      stall_seconds=time.perf_counter() - started)
                t_wait = time.perf_counter()
                concurrent.futures.wait([busy], self.session.timeout)
                waited = time.perf_counter() - t_wait
                if not busy.done():
                    raise Timeout(
                        f"save of step {step}: the snapshot in flight did not finish "
                        f"within {self.session.timeout} s",
                        step=step,
                    )
                # The snapshot waited for may have failed just now; its done-callback
                # may not have run yet. Record it (once per step) and surface it here,
                # before a new snapshot is staged past it.
                failed = None if busy.cancelled() else busy.exception()
                if failed is not None and self._inflight_step is not None:
                    self._snapshot_failed(self._inflight_step, self._inflight_serial, failed)
                self.surface_failure(stacklevel=4)
            serial = next(self._serials)
            future, copy_done, pieces = self._stage_and_submit(step, serial, flat.tree,
                                                               flat.tensors, placements, meta,
                                                               started, pending, coordinated)
            self.failures.saves += 1
            settled = self._settled = threading.Event()
        future.add_done_callback(functools.partial(self._snapshot_done, step=step,
                                                   serial=serial, meta=meta))
        future.add_done_callback(lambda _: settled.set())  # runs after _snapshot_done
        if block_training and copy_done is not None:
            copy_done.block_streams()
        stall = time.perf_counter() - started
        log.debug("%s/%d: step %d staged in %d piece(s), save() took %.4f s",
                  self.config.job, self.config.rank, step, pieces, stall)
        handle = SaveHandle(step, future, copy_done=copy_done, stall_seconds=stall,
                            waited_seconds=waited, pieces=pieces,
                            on_failure_seen=functools.partial(self._failure_seen, step, serial))
        with self._saves_lock:
            _keep_recent(self._handles, step, handle)
        return handle

    def saved(self, step: int) -> SaveHandle | None:
        """The handle of this checkpointer's save of ``step`` since it last restored,
        unless that save was skipped or failed: a coordinated snapshot due at ``step``
        is that save (the README's loop saves, then reports the step)."""
        with self._saves_lock:
            handle = self._handles.get(step)
        if handle is None or not handle.done():
            return handle
        future = handle.future
        if future is None or future.cancelled() or future.exception() is not None:
            return None
        return handle

    def forget_saves(self) -> None:
        """The loop went back to a committed step (a restore): saves before it do not
        stand for the steps it trains again."""
        with self._saves_lock:
            self._handles.clear()
            self._manifests.clear()

    def _stored(self, manifest: RankManifest, *, coordinated: bool) -> None:
        with self._saves_lock:
            _keep_recent(self._manifests, manifest.step, (manifest, coordinated))

    def _stage_and_submit(
        self,
        step: int,
        serial: int,
        tree: dict[str, Any],
        tensors: list[tuple[str, torch.Tensor]],
        placements: dict[str, tuple[Placement, list[int], list[int]]],
        meta: dict[str, Any],
        started: float,
        epoch_pending: concurrent.futures.Future[int] | None = None,
        coordinated: bool = False,
    ) -> tuple[concurrent.futures.Future[SaveResult], CopyDone | None, int]:
        """Stages the state piece by piece and hands each to the pipeline; every
        piece but the last is uploaded before the next overwrites the pool. Runs
        under ``self._lock`` with no snapshot in flight."""
        c = self.config
        plan = self.session.staging.prepare(tensors, c.chunk_size)
        with self._saves_lock:
            earlier, earlier_coordinated = self._manifests.get(step, (None, False))
        snap = Snapshot(
            job=c.job,
            step=step,
            rank=c.rank,
            world_size=c.world_size,
            chunk_size=c.chunk_size,
            tree=tree,
            tensors=plan.infos,
            placements=placements,
            meta=meta,
            started=started,
            epoch_pending=epoch_pending,
            earlier=earlier,
            coordinated=coordinated or earlier_coordinated,
        )
        upload = SnapshotUpload(self.session.transport, snap, plan.piece_count,
                                on_manifest=functools.partial(self._stored,
                                                              coordinated=snap.coordinated))
        self.failover.staging()  # what peers were served is about to be overwritten
        for number in range(plan.piece_count):
            piece = self.session.staging.stage(plan, number, step)
            if piece.last:
                future = self.session.loop.submit(self._named(upload.finish(piece), step))
                future.add_done_callback(functools.partial(self._uploaded, upload=upload,
                                                           piece=piece))
                self._inflight, self._inflight_step = future, step
                self._inflight_serial = serial
                return future, piece.copy_done, plan.piece_count
            sent = self.session.loop.submit(upload.send(piece))
            # It reads the pool: nothing may overwrite the pool before it is sent.
            self._inflight, self._inflight_step = sent, step
            self._inflight_serial = serial
            done, _ = concurrent.futures.wait([sent], self.session.timeout)
            if not done:
                return _failed(self._name(Timeout(
                    f"piece {number + 1} of {plan.piece_count} was not "
                    f"uploaded within {self.session.timeout} s; the snapshot is abandoned",
                    step=step,
                ), step)), None, plan.piece_count
            exc = sent.exception()
            if exc is not None:
                return _failed(self._name(exc, step)), None, plan.piece_count
        raise AssertionError("a staging plan has at least one piece")

    def _name(self, exc: BaseException, step: int) -> CkptdError:
        return name_save_error(exc, self.config.job, step, self.config.rank)

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
        self, future: concurrent.futures.Future[SaveResult], *, step: int, serial: int,
        meta: dict[str, Any],
    ) -> None:
        """A snapshot finished: a failure is recorded (logged, held for the loop,
        sent in heartbeats); a pending commit is remembered, to be asked about."""
        if future.cancelled():
            self._snapshot_failed(step, serial, CkptdError("the snapshot was cancelled"))
            return
        exc = future.exception()
        if exc is not None:
            self._snapshot_failed(step, serial, exc)
            return
        with self._pending_lock:
            if future.result().state == "pending":
                self._pending_commits[step] = (serial, meta)
                while len(self._pending_commits) > MAX_PENDING_ASKED:
                    del self._pending_commits[next(iter(self._pending_commits))]
            else:  # committed: what was pending before it no longer matters
                for older in [s for s in self._pending_commits if s <= step]:
                    del self._pending_commits[older]

    def settle(self, timeout: float | None) -> bool:
        """Waits up to ``timeout`` seconds for the last snapshot and its done-callback
        (its failure recorded and reported, its pending commit noted); False when
        the time ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        busy, settled = self._inflight, self._settled
        if busy is not None and not concurrent.futures.wait([busy], timeout).done:
            return False
        if settled is None:
            return True
        return settled.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _failure_seen(self, step: int, serial: int, exc: BaseException) -> None:
        """``wait()`` is about to raise ``exc``: recorded (named, logged) first, since
        the snapshot's done-callback may run only after the waiter woke, then seen."""
        self._snapshot_failed(step, serial, exc)
        self.failures.seen(exc)

    def _snapshot_failed(self, step: int, serial: int, exc: BaseException) -> None:
        err = self.failures.record(step, exc, serial)
        if err is not None:
            self.failover.snapshot_failed(str(err))

    def ask_pending(self, timeout: float | None = None) -> None:
        """Asks, in the background (at most twice a second), whether a step that was
        pending here committed: the oldest and the newest in turn (a committed one
        settles the older ones); a step that cannot commit is recorded as this
        rank's failure too. With ``timeout`` (closing), asks about every pending
        step at once and judges the answers newest first, within ``timeout`` in all,
        and logs the steps still undecided (``CloseResult.pending``).

        Not the oldest alone: a rank that is always first to commit sees every step
        pending, and asking the oldest one at a time fell behind a fast loop until
        it asked about a step retention was removing since it committed, which the
        server answers as not committed: a failure raised into the loop for a step
        that had committed. Not the newest alone: while it is still pending, an
        older step's failure (replicas that disagree) would wait for close()."""
        with self._pending_lock:
            pending = sorted(self._pending_commits.items(), reverse=True)
        if not pending:
            return
        if timeout is not None:
            self._ask_every_pending(pending, timeout)
            if left := self.undecided():
                log.info("%s/%d: closing with step(s) %s saved here and not yet committed "
                         "(other ranks' manifests not all in): `ckptd ls %s` says what came "
                         "of them", self.config.job, self.config.rank,
                         ", ".join(map(str, left)), self.config.job)
            return
        check = self._pending_check
        if (check is not None and not check.done()) or (
            time.monotonic() - self._pending_asked < 0.5
        ):
            return
        self._ask_newest = not self._ask_newest
        step, (serial, meta) = pending[0] if self._ask_newest else pending[-1]
        self._pending_asked = time.monotonic()
        check = self._ask(step, meta)
        check.add_done_callback(functools.partial(self._pending_answer, step=step,
                                                  serial=serial))
        self._pending_check = check

    def undecided(self) -> tuple[int, ...]:
        """The steps saved here whose commit is still pending, oldest first (at most
        ``MAX_PENDING_ASKED``: older ones were let go)."""
        with self._pending_lock:
            return tuple(sorted(self._pending_commits))

    def _ask_every_pending(self, pending: list[tuple[int, tuple[int, dict[str, Any]]]],
                           timeout: float) -> None:
        """Closing: every pending step asked at once (one slow answer no longer
        holds back the questions after it: on a loaded host, a step that could
        never commit went unasked), the answers judged newest first, so a committed
        step settles the older ones before their answers count. An answer still out
        at the deadline ends the judging: the older ones may be settled by it (a step
        retention removed after it committed reads as failed), and a false failure
        at close is worse than one a peer's commit already reported."""
        deadline = time.monotonic() + timeout
        asked = [(step, serial, self._ask(step, meta)) for step, (serial, meta) in pending]
        for step, serial, check in asked:
            left = deadline - time.monotonic()
            if left <= 0 or not concurrent.futures.wait([check], left).done:
                break
            with self._pending_lock:
                if step not in self._pending_commits:  # a newer one committed
                    continue
            self._pending_answer(check, step=step, serial=serial)

    def _ask(self, step: int, meta: dict[str, Any] | None) -> concurrent.futures.Future[Any]:
        """Whether pending ``step`` committed (a commit request: it commits the step
        when every rank is in), on the session's loop."""
        return self.session.loop.submit(
            self.session.transport.commit(self.config.job, step, meta or None))

    def _pending_answer(
        self, future: concurrent.futures.Future[Any], *, step: int, serial: int
    ) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            if future.result().state == "committed":
                with self._pending_lock:  # (what was pending before it no longer matters)
                    for older in [s for s in self._pending_commits if s <= step]:
                        del self._pending_commits[older]
            return
        if isinstance(exc, ValidationFailed | Conflict):  # never commits: a failure
            with self._pending_lock:
                self._pending_commits.pop(step, None)
            self._snapshot_failed(step, serial, exc)
        else:  # the server may be back next time
            log.debug("%s/%d: cannot ask whether step %d committed: %s", self.config.job,
                      self.config.rank,
                      step, exc)

    def surface_failure(self, stacklevel: int = 3) -> None:
        """Raises (or warns of) a failed snapshot the loop has not seen yet."""
        err = self.failures.take()
        if err is None:
            return
        if self.config.on_error == "raise":
            raise err
        warnings.warn(str(err), SnapshotFailureWarning, stacklevel=stacklevel)

    def _uploaded(
        self,
        future: concurrent.futures.Future[SaveResult],
        *,
        upload: SnapshotUpload,
        piece: StagedPiece,
    ) -> None:
        """Once a snapshot is in: its last piece is what the pool holds; serve it to
        peers when the step is committed, while the pool still holds it."""
        if future.cancelled() or future.exception() is not None or self.session.closed:
            return
        result = future.result()
        if result.kept_earlier:  # the pool holds the bytes that were not stored
            return
        pool, generation = self.session.staging, piece.generation
        index = PeerIndex(step=result.step, chunks=upload.chunks_of(piece),
                          valid=lambda: pool.generation == generation)
        try:
            self.failover.uploaded(index, result.state == "committed")
        except Exception as exc:  # serving peers is best effort; the save succeeded
            log.warning("%s/%d: cannot serve step %d to peers: %s", self.config.job,
                        self.config.rank,
                        result.step, exc)


def _save_args(
    shards: Mapping[str, Shard] | None, local: Iterable[str] | None, meta: Mapping[str, Any] | None,
    tag: str | None,
) -> tuple[Mapping[str, Shard], list[str], dict[str, Any]]:
    """``save()``'s arguments checked before anything is staged (a mistake is the
    caller's to fix, not a background failure after the upload): the shards, the
    local names as a list, and the meta with the tag in it."""
    if shards is None:
        shards = {}
    elif not isinstance(shards, Mapping):
        raise InvalidRequest(f"shards must map tensor names to Shard(global_shape, offsets), "
                             f"not {type(shards).__name__}")
    if isinstance(local, str | bytes):
        raise InvalidRequest(f"local={local!r} is one string: pass a list of tensor names, "
                             f"local=[{local!r}]")
    try:
        names = [] if local is None else list(local)  # (None: none, as for shards=)
    except TypeError:
        raise InvalidRequest(f"local must be a list of tensor names, not "
                             f"{type(local).__name__}") from None
    if meta is None:
        meta = {}
    elif not isinstance(meta, Mapping):
        raise InvalidRequest(f"meta must be a dict of JSON values, not {type(meta).__name__}")
    out = dict(meta)
    if tag is not None:
        if out.get(TAG_META) not in (None, tag):
            raise InvalidRequest(f"tag={tag!r} and meta['tag']={out[TAG_META]!r} differ: "
                                 "pass the tag once, as tag=")
        out[TAG_META] = tag  # the commit tags the step
    if out.get(TAG_META) is not None:
        # The commit would refuse it only after the whole upload: the step lost.
        check_new_tag(out[TAG_META])
    return shards, names, out


def _keep_recent(saves: dict[int, Any], step: int, value: Any) -> None:
    """``saves[step] = value``, keeping the newest ``MAX_PENDING_ASKED`` steps."""
    saves.pop(step, None)
    saves[step] = value
    while len(saves) > MAX_PENDING_ASKED:
        del saves[next(iter(saves))]


def _failed(exc: BaseException) -> concurrent.futures.Future[SaveResult]:
    future: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
    future.set_exception(exc)
    return future
