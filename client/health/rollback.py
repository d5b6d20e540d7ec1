"""A rank's side of a rollback, one half of ``HealthAgent`` (``agent.py``): the
request a non-finite loss makes (the job's marker, set through the server), and
the markers heartbeat replies name, told to the loop once per rollback and never
to a rank that already restored into the rollback's timeline. The repository
clears a marker once a step past it commits in its timeline
(docs/design/005-rollback-timelines.md)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptd.errors import CkptdError, Forbidden, RollbackRequested, Unauthorized
from ckptd.format import check_step

from ..transport_http import SyncTransport
from .heartbeat import Heartbeat, clip_reason
from .probe import Action, HealthProbe

log = logging.getLogger(__name__)

# Setting the marker again after the server did not answer: attempts, and the
# longest wait between two (1, 2, 4, 8, then 10 s: about 4 minutes in all). A
# refused token (401/403) is not tried again: the server answered, and asking
# again changes nothing until the token is fixed.
MARKER_ATTEMPTS = 28
MARKER_RETRY_MAX_S = 10.0

# What a rollback request answers: the step to go back to (None: nothing is
# committed, or it could not be learned) and whether it is known.
RollbackAnswer = tuple[int | None, bool]


class AgentRollbacks:
    """The rollback state and steps of a ``HealthAgent``, under the agent's lock."""

    # Set by HealthAgent.__init__.
    job: str
    rank: int
    timeout: float
    probe: HealthProbe
    _lock: threading.Lock
    _heartbeat: Heartbeat | None
    _server: SyncTransport | None
    _may_write: bool  # False: a token that may only read (no marker is set)
    _latest_fn: Callable[[], int | None] | None
    _epoch_fn: Callable[[], int | None] | None

    def _init_rollbacks(self, restored: tuple[int, int | None] | None = None) -> None:
        # The non-finite step and the request for it, not yet raised; the
        # marker step this rank was told of (and when); the step told, not yet
        # acknowledged; the timeline this rank's last restore joined.
        self._local_rollback: tuple[int | None, concurrent.futures.Future[Any]] | None = None
        # Rollback requests have a worker of their own: the loop waits for them, and
        # must not wait behind a snapshot request to a slow server.
        self._rollback_worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"ckptd-rollback-{self.job}-{self.rank}")
        self._marker_retry: threading.Timer | None = None
        # (step, epoch): the epoch tells two rollbacks to one step apart (None: the
        # rollback this rank asked for, whose epoch the reply did not say).
        self._told: tuple[int, int | None] | None = None
        self._told_at = 0.0
        self._asked_epoch: int | None = None
        self._unacked: int | None = None
        # A rank in the marker's timeline (or a later one) has restored a step of
        # it already: a restarted process that restored before it made its agent.
        self._joined: int | None = restored[1] if restored is not None else None

    @property
    def rollback_to(self) -> int | None:
        """The step this rank must go back to and has not acknowledged yet, or None.
        Reading it counts as being told: ``step`` does not raise for it again."""
        self._rollback_news()
        with self._lock:
            return self._unacked

    def acknowledge_rollback(self, step: int, *, epoch: int | None = None) -> None:
        """The loop restored ``step``: forget the non-finite loss and step timings;
        a marker naming ``step`` needs no further rollback on this rank, nor does a
        marker of timeline ``epoch`` or earlier (the one the restore joined)."""
        step = check_step(step)
        self.probe.reset_loop()
        marker = self._marker()
        with self._lock:
            self._unacked = None
            self._local_rollback = None
            if epoch is not None:
                self._joined = epoch
            if marker is not None and marker[0] == step and not _same(self._told, marker):
                self._told, self._told_at = marker, time.time()
        log.info("%s/%d: rolled back to step %d", self.job, self.rank, step)

    def _marker(self) -> tuple[int, int] | None:
        """The rollback marker the last heartbeat reply named, with the job's epoch."""
        reply = self._heartbeat.last_reply if self._heartbeat is not None else None
        if reply is None or reply.rollback_to is None:
            return None
        return reply.rollback_to, reply.rollback_epoch

    def _rollback_news(self) -> RollbackRequested | None:
        """A rollback this rank was not told of yet, as the error to raise (now told)."""
        with self._lock:
            local, self._local_rollback = self._local_rollback, None
        if local is not None:
            bad_step, request = local
            answer: RollbackAnswer | None
            try:
                answer = request.result(self.timeout)
            except Exception as exc:  # a timeout or a cancelled request: still stop the loop
                log.warning("%s/%d: the rollback request did not finish: %s",
                            self.job, self.rank, exc)
                answer = None
            target, known = answer if answer is not None else (None, False)
            with self._lock:
                self._unacked = target
                if target is not None:
                    self._told, self._told_at = (target, self._asked_epoch), time.time()
            if target is not None:
                where = f"go back to step {target}"
            elif known:
                where = "no committed step to go back to"
            else:
                where = ("the step to go back to could not be learned from the server: "
                         "restore the latest committed step")
            return RollbackRequested(
                f"{self.job}/{self.rank}: the loss at step {bad_step} is not finite: {where}",
                step=bad_step, rollback_to=target, rollback_unknown=not known,
            )
        reply = self._heartbeat.last_reply if self._heartbeat is not None else None
        if reply is None:
            return None
        marker = self._marker()
        with self._lock:
            if marker is None:
                # Forget the marker once a heartbeat sent after it was told says it is
                # gone, so that a marker set again at the same step is told again.
                sent = reply.received_at - reply.rtt_ms / 1000.0
                if self._told is not None and sent > self._told_at:
                    self._told = None
                return None
            if _same(self._told, marker):
                if self._told != marker:
                    self._told = marker  # the epoch of the rollback this rank asked for
                return None
            if self._joined is not None and self._joined >= marker[1]:
                # This rank restored a step of the rollback's timeline already.
                self._told, self._told_at = marker, time.time()
                return None
            self._told, self._told_at = marker, time.time()
            self._unacked = marker[0]
        log.warning("%s/%d: the job is marked for rollback to step %d (timeline %d)", self.job,
                    self.rank, marker[0], marker[1])
        return RollbackRequested(f"job {self.job} is marked for rollback to step {marker[0]}",
                                 rollback_to=marker[0])

    def _submit_rollback(self, fn: Callable[..., Any], *args: Any
                         ) -> concurrent.futures.Future[Any] | None:
        try:
            return self._rollback_worker.submit(self._guarded, fn, *args)
        except RuntimeError:  # shut down: the agent is closing
            return None

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError  # HealthAgent's

    def _close_rollbacks(self) -> None:
        with self._lock:
            retry, self._marker_retry = self._marker_retry, None
        if retry is not None:
            retry.cancel()
        self._rollback_worker.shutdown(wait=False, cancel_futures=True)

    def _request_rollback(self, action: Action) -> RollbackAnswer:
        with self._lock:
            self._asked_epoch = None  # until this request's answer says
        reason = clip_reason(f"rank {self.rank}: {action.reason}")
        # The timeline this rank is in: when a rollback already ended it (another
        # rank's NaN), this request is answered by that rollback, not a new one.
        epoch = self._epoch_fn() if self._epoch_fn is not None else None
        try:
            target = self._latest()
        except (Unauthorized, Forbidden) as exc:
            self._refused(action.step, None, exc)
            return None, False
        except CkptdError as exc:
            log.error("%s/%d: the loss at step %s is not finite, and the latest committed step "
                      "cannot be read ([%s] %s): restore the latest; the rollback marker is set "
                      "once the server answers", self.job, self.rank, action.step, exc.code,
                      exc.message)
            self._retry_marker(None, reason, epoch, 1)
            return None, False
        if target is None:
            log.error("%s/%d: the loss at step %s is not finite and the job has no committed "
                      "step to go back to", self.job, self.rank, action.step)
            return None, True
        if self._server is None or not self._may_write:
            log.error("%s/%d: the loss at step %s is not finite: this rank goes back to step "
                      "%d (%s: no rollback marker for the other ranks)", self.job,
                      self.rank, action.step, target,
                      "no server" if self._server is None else "a token that may only read")
            return target, True
        try:
            step = self._set_marker(target, reason, epoch)
        except (Unauthorized, Forbidden) as exc:
            self._refused(action.step, target, exc)
            return target, True
        if step is None:
            self._retry_marker(target, reason, epoch, 1)
            return target, True
        log.error("%s/%d: the loss at step %s is not finite: the job is marked for rollback "
                  "to step %d", self.job, self.rank, action.step, step)
        return step, True

    def _refused(self, bad_step: int | None, target: int | None, exc: CkptdError) -> None:
        """The server refused this rank's token while it asked for a rollback: said
        once, with what to do (nothing is tried again)."""
        where = (f"go back to step {target}" if target is not None
                 else "restore the latest committed step")
        loss = "the loss" if bad_step is None else f"the loss at step {bad_step}"
        log.error("%s/%d: %s is not finite: %s. The server refused this "
                  "rank's token ([%s] %s), so no rollback marker tells the other ranks: "
                  "use a token whose scope covers job %r with write access (`ckptd token "
                  "create --job %s --role write`), or run `ckptd rollback %s STEP` with "
                  "one", self.job, self.rank, loss, where, exc.code, exc.message,
                  self.job, self.job, self.job)

    def _set_marker(self, target: int, reason: str, epoch: int | None) -> int | None:
        """Marks the job for rollback to ``target``; the marker's step, or None when
        the server did not answer (logged). A refused token raises."""
        assert self._server is not None
        try:
            answer = self._server.set_rollback(self.job, target, reason, from_epoch=epoch)
        except (Unauthorized, Forbidden):
            raise
        except CkptdError as exc:
            log.error("%s/%d: setting the rollback marker to step %d failed: [%s] %s",
                      self.job, self.rank, target, exc.code, exc.message)
            return None
        with self._lock:
            self._asked_epoch = answer.epoch
        if self._heartbeat is not None:
            self._heartbeat.beat_now()  # the health (loss_nonfinite) goes out at once
        return answer.rollback_to if answer.rollback_to is not None else target

    def _retry_marker(self, target: int | None, reason: str, epoch: int | None,
                      attempt: int) -> None:
        """Sets the marker later: the other ranks must hear of the rollback once the
        server is back (``MARKER_ATTEMPTS`` tries, then it is logged and left)."""
        if self._server is None or not self._may_write:
            return
        if attempt > MARKER_ATTEMPTS:
            log.error("%s/%d: the rollback marker could not be set after %d attempts: the "
                      "other ranks are not told (run `ckptd rollback %s STEP`)", self.job,
                      self.rank, MARKER_ATTEMPTS, self.job)
            return
        delay = min(MARKER_RETRY_MAX_S, 2.0 ** (attempt - 1))
        timer = threading.Timer(delay, self._submit_rollback,
                                (self._set_marker_again, target, reason, epoch, attempt))
        timer.daemon = True
        with self._lock:
            self._marker_retry = timer
        timer.start()

    def _set_marker_again(self, target: int | None, reason: str, epoch: int | None,
                          attempt: int) -> None:
        try:
            step = target if target is not None else self._latest()
            if step is None:
                return  # nothing committed to go back to
            marked = self._set_marker(step, reason, epoch)
        except (Unauthorized, Forbidden) as exc:
            self._refused(None, target, exc)
            return
        except CkptdError:
            self._retry_marker(target, reason, epoch, attempt + 1)
            return
        if marked is None:
            self._retry_marker(target, reason, epoch, attempt + 1)
            return
        with self._lock:
            # This rank went on without the marker's timeline (it restored while the
            # server was away): it is told of the marker like every other rank.
            if self._told is not None and self._told[1] is None:
                self._told = None
        log.warning("%s/%d: the job is marked for rollback to step %d now that the server "
                    "answers", self.job, self.rank, marked)

    def _latest(self) -> int | None:
        # The agent's own one try first: the loop waits on it after a NaN, and the
        # Checkpointer's ``latest`` retries a server that does not answer for seconds.
        if self._server is not None:
            return self._server.latest(self.job)
        if self._latest_fn is not None:
            return self._latest_fn()
        return None


def _same(told: tuple[int, int | None] | None, marker: tuple[int, int]) -> bool:
    """Whether the rollback told of is the marker's (an unknown epoch matches any)."""
    return told is not None and told[0] == marker[0] and told[1] in (None, marker[1])

