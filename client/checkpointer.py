"""The in-process client: ``Checkpointer.save`` stages and returns at once, a
background pipeline uploads; ``Checkpointer.restore`` fills a state dict in place.

Staging (``staging/``) copies the state into a reusable shared-memory pool;
the save flow (``save/``) hashes, dedups and uploads from that pool. One
snapshot per rank is in flight at a time, so the pool holds one staged copy.

Failover (with a server): the checkpointer serves its pool's committed chunks to
peers (``peer/``) and heartbeats (``heartbeat.py``); ``restore`` takes each chunk
from the first tier that has it right (``restore/``): this node's pool, a local
cache directory, peers, the store.

Just past the house's ~500 lines on purpose: this is the public face, and most of
its lines are the docstrings of the calls users read (``save``, ``restore``,
``step``); the work is in the packages named above.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Coroutine, Iterable, Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from ckptd.errors import CkptdError

from .config import CheckpointerConfig, DefaultPlacement, OnBusy, OnError
from .failover import FailoverAgent
from .failures import CloseResult
from .health.heartbeat import Heartbeat, HeartbeatReply
from .launch import group_initialized, launch_incarnation
from .peer import PeerServer
from .restore.meet import PoolMeet
from .restore.restorer import Restorer, RestoreResult
from .save.handle import SaveHandle
from .save.placement import Shard
from .save.saver import Saver
from .session import Session
from .staging.pool import StagingPool
from .timeline import Timeline
from .transport import Transport

if TYPE_CHECKING:
    from .health.agent import HealthAgent
    from .health.heartbeat import HealthFn
    from .health.policy import Policy
    from .health.readings import ReadingSource

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Checkpointer", "CheckpointerConfig", "RestoreResult", "SaveHandle", "Shard"]


class Checkpointer:
    """Asynchronous, deduplicated, verified checkpoints of one rank's state.

    ``url`` is ``http://host:port`` (a ckptd server), or a store used directly
    (``file:///path``, ``s3://bucket/prefix``: docs/client.md). One snapshot per rank is
    in flight at a time: a ``save`` while one is in flight waits for it
    (``on_busy="wait"``) or is skipped (``on_busy="skip"``). Tensors are
    ``"replicated"`` across ranks by default (the server checks that replicas agree and
    dedups them), ``"local"`` when named in ``local`` (rank-private), or ``"sharded"``
    when given a ``Shard`` (or when they are DTensors, whose placements say where their
    shard sits). ``timeout`` bounds every blocking call that takes no timeout of its own
    (None: no bound). ``url`` and ``token`` default to ``CKPTD_URL`` and
    ``CKPTD_TOKEN``; ``rank``, ``world_size`` and ``local_rank`` (this rank's GPU, whose
    health the probe watches) to the ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` that
    torchrun (or any launcher of torch's env:// convention) sets, else 0, 1 and none.

    With an ``http(s)://`` server the constructor asks the server once (the job's
    rollback state): a server nothing answers for at ``url`` (refused connections
    for ``CKPTD_SERVER_WAIT`` seconds, 20, while it may be starting or restarting,
    said in a warning after 2; no answer to a connection within
    ``CKPTD_CONNECT_TIMEOUT``, 3), one that refuses the token, or
    another program at that port raises there, one typed error (``Unavailable``,
    ``Unauthorized``, ``Forbidden``, ``InvalidRequest``) naming the URL and what to
    do.

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
    ``CKPTD_PEER_HOST`` / ``CKPTD_PEER_PORT``, every interface and a port the OS
    picks, so that ranks on other hosts reach it; it advertises this host's address
    on the route to the server, or ``CKPTD_PEER_INTERFACE``'s, or
    ``CKPTD_PEER_ADVERTISE_HOST``; the job's peer token guards it) and heartbeats
    to the server every ``heartbeat_interval`` seconds (the server's interval once
    it answered) with its peer address, the loop's step (``note_step``), the committed step it
    holds and ``health()`` (default: ok). ``cache_dir`` (default
    ``CKPTD_CACHE_DIR``) is a local directory store that ``restore`` reads before
    peers, e.g. what ``ckptd restore --to DIR`` filled.

    ``incarnation`` names this launch of the job, the same on every rank of it
    (default: the id the ranks of the process group agreed on, when
    ``torch.distributed`` is initialized, after ``CKPTD_INCARNATION`` when that is
    set; else ``CKPTD_INCARNATION``, torchrun's run id and restart count on one
    node, SLURM's job id and requeue count; ``client/launch.py``): a restarted
    job's manifest replaces a pending one of the launch that died, and no step
    commits with manifests of two launches. A checkpointer made before
    ``init_process_group`` and not given ``incarnation`` takes the group's launch at
    its first save once the group is there. Unknown (None), a restart is
    not told apart: a rank that saved the pending step before gets ``Conflict``,
    and the step may commit with that rank's earlier manifest.

    All settings together are one ``CheckpointerConfig``
    (``Checkpointer.from_config``); the checkpointer composes a ``Saver``, a
    ``Restorer`` and a ``FailoverAgent`` over one ``Session``."""

    def __init__(
        self,
        url: str | None = None,
        job: str = "",
        rank: int | None = None,
        world_size: int | None = None,
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
        incarnation: str | None = None,
        local_rank: int | None = None,
    ) -> None:
        """Builds the ``CheckpointerConfig`` of these arguments and opens it."""
        # Made before the process group: the launch the group's ranks agree on is
        # taken at the first save once there is one (``_take_group_launch``).
        later = incarnation is None and not group_initialized()
        self._open(CheckpointerConfig.of(
            url, job, rank, world_size, token, chunk_size=chunk_size,
            default_placement=default_placement, on_busy=on_busy, on_error=on_error,
            timeout=timeout, staging_budget=staging_budget, shm_dir=shm_dir,
            serve_peers=serve_peers, peer_host=peer_host, peer_port=peer_port,
            heartbeat_interval=heartbeat_interval, health=health, cache_dir=cache_dir,
            health_policy=health_policy, health_sources=health_sources,
            incarnation=incarnation, local_rank=local_rank,
        ), launch_later=later)

    @classmethod
    def from_config(cls, config: CheckpointerConfig) -> Checkpointer:
        """A checkpointer made of ``config``."""
        self = cls.__new__(cls)
        self._open(config)
        return self

    def _open(self, config: CheckpointerConfig, *, launch_later: bool = False) -> None:
        self.config = config
        self._launch_later = launch_later
        if config.incarnation is None and config.world_size > 1 and not launch_later:
            _say_no_launch(config)
        self._session = Session(config)
        try:
            self._session.reach()  # an unreachable server or a refused token: said now
        except CkptdError as exc:
            self._session.close()
            # Its frames are the background loop's: the message says all there is.
            raise exc.with_traceback(None) from None
        except BaseException:
            self._session.close()
            raise
        try:
            self._failover = FailoverAgent(self._session)
        except BaseException:
            self._session.close()
            raise
        self._timeline = Timeline(self._session)
        self._saver = Saver(self._session, self._timeline, self._failover)
        self._restorer = Restorer(self._session)

    # -- the config's values, as attributes ----------------------------------------------

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def job(self) -> str:
        return self.config.job

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def default_placement(self) -> DefaultPlacement:
        return self.config.default_placement

    @property
    def on_busy(self) -> OnBusy:
        return self.config.on_busy

    @property
    def on_error(self) -> OnError:
        return self.config.on_error

    @property
    def cache_dir(self) -> str | os.PathLike[str] | None:
        return self.config.cache_dir

    @property
    def timeout(self) -> float | None:
        """The bound of every blocking call without a timeout of its own (settable)."""
        return self._session.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._session.timeout = value

    # -- parts ---------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        """The transport (it lives on this checkpointer's background loop)."""
        return self._session.transport

    @property
    def _transport(self) -> Transport:
        return self._session.transport

    @_transport.setter
    def _transport(self, transport: Transport) -> None:  # tests wrap it to inject trouble
        self._session.transport = transport

    @property
    def staging(self) -> StagingPool:
        """The staging pool (its ``stats`` count what it allocated)."""
        return self._session.staging

    @property
    def peer_server(self) -> PeerServer | None:
        """The peer chunk server (None with a ``file://`` store or ``serve_peers=False``)."""
        return self._failover.server

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The heartbeat sender (None with a ``file://`` store)."""
        return self._failover.heartbeat

    @property
    def last_heartbeat_reply(self) -> HeartbeatReply | None:
        """The server's last answer to a heartbeat (``snapshot_at``, ``rollback_to``)."""
        return self._failover.last_heartbeat_reply

    def note_step(self, step: int) -> None:
        """Tells heartbeats the training loop's current step (``save`` does too)."""
        self._failover.note_step(step)

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.transport.describe()!r}, job={self.job!r}, "
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

    # -- save -----------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[Any, Any],
        *,
        shards: Mapping[str, Shard] | None = None,
        local: Iterable[str] | None = (),
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
        cannot be stored (``UnsupportedValue``, naming the path) and for mistaken
        arguments, a malformed ``tag`` included (``InvalidRequest``); errors of the
        upload come out of ``SaveHandle.wait()``, and out of the next ``save()``,
        ``step()`` or ``close()`` (see ``on_error``). Objects with ``state_dict()``
        and ``load_state_dict()`` (a module, optimizer, scheduler, ``RNGState``) are
        saved as their ``state_dict()``; raw ``bytes`` as opaque verified blobs."""
        self._take_group_launch()
        return self._saver.save(step, state, shards=shards, local=local, meta=meta,
                                block_training=block_training, tag=tag)

    def _take_group_launch(self) -> None:
        """Made before the process group and not told the launch: once there is a
        group, its launch id (``launch_incarnation``), as the ranks that made theirs
        after it have: otherwise the two kinds of rank named different launches,
        and no step ever committed (nor said why)."""
        if not self._launch_later:
            return
        if group_initialized():
            self._launch_later = False
            found = launch_incarnation()
            if found is not None and found != self.config.incarnation:
                log.info("%s/%d: the process group came after this checkpointer; its saves "
                         "name the group's launch, %s", self.job, self.rank, found)
                config = self.config.replace(incarnation=found)
                self.config = self._session.config = self._saver.config = config
        if self.config.incarnation is None and self.config.world_size > 1:
            _say_no_launch(self.config)

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
        strict: bool = True,
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

        ``strict`` (default, as torch's ``load_state_dict``): an entry the target
        holds that the checkpoint lacks (a module's new parameter, a plain key), or
        an entry of the checkpoint that a module has no place for, raises
        ``RestoreError`` naming the first few before anything changes;
        ``strict=False`` leaves the first as they are and skips the second (modules
        get ``load_state_dict(strict=False)``). Entries a plain mapping lacks are
        created either way; optimizers, schedulers and ``RNGState`` check their own.

        Objects with ``state_dict()`` and ``load_state_dict()`` (a module, an
        optimizer, a scheduler, ``RNGState``) are restored through their
        ``state_dict()`` and get it back by ``load_state_dict()``. The result's
        ``step`` is the step restored: ``start = ckpt.restore(state).step + 1``.

        A pool that verified as this rank's whole manifest is then served to peers."""
        self._session.check_open()
        use = self._restorer.check(state, tiers)
        before = self._timeline.rollback_state()
        step = self._timeline.step_to_restore(step, before)
        # A rank with no pool (a replacement node's) waits for the others to serve
        # theirs before it plans; a rank with one says so once it serves it.
        meet = PoolMeet.here(self.job, self.rank, self.world_size) if "peer" in use else None
        if meet is not None and not self._restorer.holds_pool():
            meet.say()
            meet.wait_for_others()
        try:
            result, fetched = self._restorer.restore(
                state, step, use=use, shards=shards, atomic=atomic, timeout=timeout,
                strict=strict, exclude_peers=tuple(u for u in (self._failover.url,) if u),
                adopt=self._failover.server is not None,  # (nobody to serve the pool to)
            )
            self._saver.forget_saves()  # the loop trains on from a committed step
            if fetched.adopted is not None and fetched.pool is not None:
                self._failover.adopted(fetched.adopted, fetched.pool, beat=meet is not None)
        finally:
            if meet is not None:
                meet.say()
        joined = self._timeline.join(result.step, before)
        self._failover.restored(result.step, joined)
        return result

    @property
    def epoch(self) -> int | None:
        """The job's timeline this rank saves in (how many rollbacks the job had when
        this checkpointer started or last restored), or None while not known."""
        return self._timeline.epoch

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
        the reason); returns None otherwise. When the loop saved this step already
        (``save()`` before ``step()``, as the README's loop does), that save is the
        snapshot and its handle is returned: nothing is saved twice. A ``save()`` of
        a step saved before (this snapshot, then the loop's own save) is the same
        save when its bytes are the same; with other bytes (``step()`` came before an
        optimizer step the loop then saved) the first save stands, the second stores
        nothing and says so, a warning and ``SaveResult.kept_earlier``: never a
        failure, the job goes on. Raises ``RollbackRequested`` (once per
        rollback) when this rank's loss went non-finite or the job was marked for
        rollback: restore ``e.rollback_to`` (the latest when it is None and
        ``e.rollback_unknown``) and carry on, or end the process for torchrun to
        restart every rank (README). A poisoned step is never
        snapshotted. A failed earlier snapshot comes out here (see ``on_error``).
        ``save_kwargs`` go to ``save()``; a ``meta`` there is recorded with the
        snapshot's reason."""
        self._session.check_open()
        self._saver.surface_failure()
        self._saver.ask_pending()
        agent = self._health_agent()
        self._failover.note_step(step)
        decision = agent.step(step, loss)
        if not decision.snapshot:
            return None
        saved = self._saver.saved(step)
        if saved is not None:  # the loop saved this step: that is the snapshot
            log.info("%s/%d: the coordinated snapshot due at step %d is the loop's save of it",
                     self.job, self.rank, step)
            return saved
        if state is None:
            log.warning("%s/%d: coordinated snapshot due at step %d, but step() got no state",
                        self.job, self.rank, step)
            return None
        meta = save_kwargs.pop("meta", None)
        if meta is None:
            meta = decision.meta
        elif isinstance(meta, Mapping):  # the caller's, and the reason for the commit
            meta = {**meta, **decision.meta}
        self._take_group_launch()
        return self._saver.save(step, state, meta=meta, coordinated=True, **save_kwargs)

    @property
    def rollback_to(self) -> int | None:
        """The committed step the job must go back to (not yet acted on), or None."""
        return self._health_agent().rollback_to

    def acknowledge_rollback(self, step: int) -> None:
        """The loop restored ``step`` by other means than ``restore()``."""
        joined = self._timeline.join(step, None)
        self._saver.forget_saves()
        self._health_agent()
        self._failover.restored(step, joined)

    def _health_agent(self) -> HealthAgent:
        with self._session.lock:
            return self._failover.health(self.latest, lambda: self.epoch)

    def adopt(self, step: int | None = None, *, timeout: float | None = None) -> int | None:
        """Re-adopts this node's staging pool: checks the chunks it holds against
        this rank's manifest of a committed step (the latest when None) and, when
        every chunk of that manifest matches, serves them to peers and says so in a
        heartbeat sent now. Returns that step, or None when the pool does not hold
        all of it (a newer save overwrote part: peers would be sent to it for the
        rest), or there is no pool, or no commit. ``restore`` does this by itself;
        calling it first on every rank (then a barrier) lets a rank that lost its
        node find its peers."""
        self._session.check_open()
        adopted = self._restorer.adopt(step, timeout)
        if adopted is None:
            return None
        held, index, pool = adopted
        self._failover.adopted(index, pool, beat=True)
        return held

    def latest(self) -> int | None:
        """The newest committed step of this job, or None."""
        self._session.check_open()
        return self._call(self.transport.latest(self.job), self.timeout)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Runs ``coro`` on the background loop; errors come out typed."""
        return self._session.call(coro, timeout)

    # -- lifecycle ----------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> CloseResult:
        """Waits for the snapshot in flight, then closes the transport and the
        background loop and removes the staging pool from shared memory.

        Returns how many saves were staged, failed and skipped; then raises a
        failed snapshot's error the loop has not seen (``on_error="raise"``) or
        warns of it. Idempotent."""
        result = self._close(timeout)
        self._saver.surface_failure()
        return result

    def _close(self, timeout: float | None = None) -> CloseResult:
        saver = self._saver
        with self._session.lock:
            if self._session.closed:
                return saver.failures.result(saver.undecided())
            self._session.closed = True
            busy = saver.inflight
        timeout = self.timeout if timeout is None else timeout
        # The snapshot and its done-callback: what it failed is in the report below.
        if busy is not None and not saver.settle(timeout):
            log.warning("%s/%d: closing with the snapshot of a save still in flight",
                        self.job, self.rank)
        try:  # a step that can never commit is this rank's failure too
            saver.ask_pending(timeout=min(timeout, 10.0) if timeout is not None else 10.0)
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.debug("%s/%d: cannot ask about the pending step: %s", self.job, self.rank, exc)
        self._failover.close(failed=bool(saver.failures.failed))
        self._session.close()
        return saver.failures.result(saver.undecided())


_said_no_launch = False


def _say_no_launch(config: CheckpointerConfig) -> None:
    """Says once per process that no launch id is known (docs/FORMAT.md, "Launches")."""
    global _said_no_launch
    if _said_no_launch:
        return
    _said_no_launch = True
    log.info("%s/%d: no launch id known (make the Checkpointer after the process group: "
             "ckptd.client.distributed.init_process_group, or dist.init_process_group with "
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; or pass incarnation=, the same on every "
             "rank of a launch, another for each launch): after a restart, a step an earlier "
             "launch saved in part may commit with that launch's manifests",
             config.job, config.rank)
