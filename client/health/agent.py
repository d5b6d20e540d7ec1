"""One rank's health agent: the probe, the heartbeat, and what the loop is told.

``HealthAgent`` owns a ``HealthProbe`` (``probe.py``) and, for an ``http(s)://``
server, a ``Heartbeat`` (``heartbeat.py``) that carries the probe's verdict; it
turns the probe's actions into requests to the server and the server's replies
into decisions at the training loop's ``step`` calls (the rollback half, its state
and its steps, is ``AgentRollbacks`` in ``rollback.py``):

- ``snapshot``: ``POST /v1/jobs/{job}/snapshot-requests``. The server names a
  target step a little ahead of the fastest rank and every heartbeat reply carries
  it; ``step(target)`` on every rank then answers ``StepDecision(snapshot=True,
  meta={"reason": "health", "requested_by": rank})``, so all ranks save the same
  step and it commits with its reason.
- ``report_failing``: the heartbeat already says ``critical``; it is sent at once.
- ``rollback`` (a NaN/Inf loss): ``POST /v1/jobs/{job}/rollback`` to the last
  committed step, and the ``step`` call that reported the loss raises
  ``RollbackRequested``. Other ranks raise it at their next ``step`` after a
  heartbeat reply names the marker.

Requests run on one worker thread, never on the probe's or the loop's; the
rollback, which the loop waits for, on one of its own (``rollback.py``); their errors are
logged, never raised into training. With ``file://`` there is no server: the probe
runs and a rollback is still raised with the latest committed step, but there are
no heartbeats, coordinated snapshots or rollback markers. With a token that may only
read the job (an eval job), likewise: the server would refuse every request.

The race (docs/policy.md, "In the training loop"): a rank learns of a target
from its next heartbeat reply. A rank already past the target when it learns of it
logs it and skips it; the step then stays pending and the server drops the target
after ``CKPTD_SNAPSHOT_TIMEOUT``. Choose the server's snapshot lead so that
``lead * step time`` exceeds about two heartbeat intervals.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

from ckptd.errors import CkptdError
from ckptd.format import check_job, check_rank, check_step

from ..transport_http import SyncTransport
from .heartbeat import Heartbeat, HeartbeatReply, clip_reason
from .policy import Policy, default_policy
from .policy_file import load_policy
from .probe import Action, HealthProbe, HealthStatus, default_sources
from .readings import LoopSource, ReadingSource, RttSource
from .rollback import AgentRollbacks

log = logging.getLogger(__name__)

# What a heartbeat's health object may hold (ckptd.api.HealthReport; text: clip_reason).
_MAX_REASONS = 64
_MAX_SIGNALS = 1024


@dataclass(frozen=True, slots=True)
class StepDecision:
    """What ``HealthAgent.step`` tells the loop: save this step now (``snapshot``),
    with ``meta`` for ``Checkpointer.save`` (it reaches the commit record)."""

    snapshot: bool = False
    reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class HealthAgent(AgentRollbacks):
    """Watches one rank's health and coordinates with the server for it.

    ``policy``: a ``Policy``, a TOML file, or None for the defaults. ``sources``:
    the probe's reading sources (default ``default_sources``, with ``disk_paths``
    and ``gpus``); a ``LoopSource`` and an ``RttSource`` are added when missing.
    ``heartbeat``: an existing ``Heartbeat`` of this rank to share (its owner starts
    and stops it; the agent sets its ``health`` and chains its ``on_beat``); else
    one is made for an HTTP server (``heartbeat_interval`` fixes its interval,
    otherwise the server's). ``latest``: the newest committed step of the job (the
    Checkpointer's ``latest``), asked where there is no server (a file:// store);
    with one, the agent asks it once itself, so that a non-finite loss while the
    server is away raises at once, not after the Checkpointer's retries. ``timeout`` bounds
    each request the agent makes, and how long ``step`` waits for the rollback
    request after a non-finite loss. ``restored``: the (committed step, timeline
    joined or None) the rank restored before the agent was made, as if
    ``acknowledge_rollback`` had been called with them.
    """

    def __init__(
        self,
        url: str,
        job: str,
        rank: int,
        world_size: int,
        token: str | None = None,
        *,
        policy: Policy | str | os.PathLike[str] | None = None,
        sources: Iterable[ReadingSource] | None = None,
        heartbeat: Heartbeat | None = None,
        heartbeat_interval: float | None = None,
        latest: Callable[[], int | None] | None = None,
        epoch: Callable[[], int | None] | None = None,
        disk_paths: Iterable[str | os.PathLike[str]] = (),
        gpus: Sequence[int | str] | None = None,
        timeout: float = 10.0,
        restored: tuple[int, int | None] | None = None,
        may_write: bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.job = check_job(job)
        self.world_size = int(world_size)
        self.rank = check_rank(rank, self.world_size, job=self.job)
        self.timeout = float(timeout)
        if policy is None:
            policy = default_policy()
        elif not isinstance(policy, Policy):
            policy = load_policy(Path(policy))
        self.policy = policy
        self.coordinated = urlparse(self.url).scheme in ("http", "https")
        found = (list(sources) if sources is not None
                 else default_sources(policy, disk_paths=disk_paths, gpus=gpus))
        if not any(isinstance(s, LoopSource) for s in found):
            found.append(LoopSource(window=policy.probe.step_window,
                                    min_samples=policy.probe.step_min_samples))
        self._loop_source = next(s for s in found if isinstance(s, LoopSource))
        if not any(isinstance(s, RttSource) for s in found):
            found.append(RttSource())
        self.probe = HealthProbe(policy, found, on_action=self._on_action)
        self._latest_fn = latest
        self._epoch_fn = epoch
        self._lock = threading.Lock()
        self._closed = False
        self._server: SyncTransport | None = None
        # A token that may only read the job: the probe runs and a non-finite loss
        # still goes back locally, but nothing is asked of the server (it would refuse).
        self._may_write = may_write
        self._said_read_only = False
        self._owns_heartbeat = False
        self._heartbeat: Heartbeat | None = None
        self._chained_on_beat: Callable[[HeartbeatReply | None, float | None], None] | None = None
        self._chained_health: Callable[[], dict[str, Any]] | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"ckptd-health-{self.job}-{self.rank}")
        # Coordinated snapshots: the target a snapshot request of ours got, the
        # targets already decided (saved or skipped), who asked for each.
        self._posted_target: int | None = None
        self._posted_at = 0.0  # time.time() when the server accepted it
        self._done_targets: set[int] = set()
        self._requested_by: dict[int, int] = {}
        self._looked_up: set[int] = set()
        self._snapshot_next: str | None = None  # file://, one rank: save at the next step
        self._init_rollbacks(restored)
        self._failing: str | None = None
        if self.coordinated:
            # One try per request, as the loop may be waiting on it (a rollback);
            # routing still moves to a live replica within it.
            self._server = SyncTransport(self.url, token, timeout=self.timeout, retries=0)
            if heartbeat is None:
                heartbeat = Heartbeat(self.url, self.job, self.rank, self.world_size, token,
                                      interval=heartbeat_interval)
                self._owns_heartbeat = True
            # Last: a shared heartbeat may already be beating on its own thread.
            self._chained_on_beat = heartbeat.on_beat
            self._chained_health = heartbeat.health
            self._heartbeat = heartbeat
            heartbeat.health = self._health_json
            heartbeat.on_beat = self._on_beat

    def __repr__(self) -> str:
        return (f"<HealthAgent {self.url} {self.job}/{self.rank} "
                f"{self.probe.status().state}>")

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> HealthAgent:
        """Starts the probe thread and, for an HTTP server, the heartbeat."""
        self.probe.start()
        if self._heartbeat is not None:
            self._heartbeat.start()
        else:
            log.info("%s/%d: %s is not a ckptd server: the health probe runs, but there are "
                     "no heartbeats, coordinated snapshots or rollback markers",
                     self.job, self.rank, self.url)
        return self

    def close(self) -> None:
        """Stops the probe, the heartbeat (when the agent made it) and the worker. No
        goodbye is sent: the server sees the rank dead after the missed heartbeats.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.probe.close()
        if self._heartbeat is not None:
            if self._owns_heartbeat:
                self._heartbeat.stop()
            else:  # hand a shared heartbeat back as it was
                self._heartbeat.on_beat = self._chained_on_beat
                if self._chained_health is not None:
                    self._heartbeat.health = self._chained_health
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._close_rollbacks()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> HealthAgent:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- what the loop calls -------------------------------------------------------------

    def step(self, step: int, loss: float | None = None) -> StepDecision:
        """Records that the loop finished ``step`` (and its loss); says whether to
        save this step now. Raises ``RollbackRequested`` once per rollback: for a
        non-finite ``loss`` (``step`` and ``rollback_to`` set), or when a heartbeat
        reply names a rollback marker this rank has not been told of yet."""
        step = check_step(step)
        self.probe.record_step(step, loss)  # a non-finite loss runs the rollback action now
        if self._heartbeat is not None:
            self._heartbeat.note_step(step)
        rollback = self._rollback_news()
        if rollback is not None:
            raise rollback
        return self._snapshot_decision(step, loss)

    def acknowledge_rollback(self, step: int, *, epoch: int | None = None) -> None:
        super().acknowledge_rollback(step, epoch=epoch)
        reply = self._heartbeat.last_reply if self._heartbeat is not None else None
        named: set[int] = set()
        if reply is not None and reply.snapshot_at is not None:
            named.add(reply.snapshot_at)
        with self._lock:
            # Targets the server no longer names were dropped with the ended
            # timeline: the loop reaches those steps again, and a new target there
            # is a new one to save.
            self._done_targets &= named
            self._looked_up &= named
            self._requested_by = {t: r for t, r in self._requested_by.items() if t in named}
            self._posted_target = None

    def status(self) -> HealthStatus:
        """The probe's latest verdict."""
        return self.probe.status()

    @property
    def failing(self) -> str | None:
        """Why the policy reported this rank as failing (``report_failing``), or None."""
        return self._failing

    @property
    def snapshot_target(self) -> int | None:
        """The coordinated snapshot step this rank knows of and has not reached, or None."""
        with self._lock:
            for target in self._targets():
                if target not in self._done_targets:
                    return target
        return None

    # -- decisions at step() -------------------------------------------------------------

    def _targets(self) -> list[int]:
        reply = self._heartbeat.last_reply if self._heartbeat is not None else None
        found = [] if reply is None or reply.snapshot_at is None else [reply.snapshot_at]
        posted = self._posted_target
        if posted is not None and posted not in found:
            # Saved only while the server may still name it: a reply sent after it
            # was accepted that names another or none (a server restart lost it, a
            # rollback dropped it) ends it, or this rank would save it alone.
            if reply is not None and reply.received_at - reply.rtt_ms / 1000.0 > self._posted_at:
                self._posted_target = None
            else:
                found.append(posted)
        return found

    def _snapshot_decision(self, step: int, loss: float | None) -> StepDecision:
        poisoned = (self.probe.nonfinite_step is not None
                    or (loss is not None and not math.isfinite(float(loss))))
        with self._lock:
            due: int | None = None
            past: list[int] = []
            for target in self._targets():
                if target in self._done_targets:
                    continue
                if target == step:
                    due = target
                elif target < step:
                    past.append(target)
            for target in past:
                self._done_targets.add(target)
            if due is not None:
                self._done_targets.add(due)
            requested_by = self._requested_by.get(due) if due is not None else None
            local, self._snapshot_next = self._snapshot_next, None
            blocked = poisoned or self._unacked is not None
        for target in past:
            log.warning("%s/%d: learned of the coordinated snapshot at step %d at step %d, "
                        "past it: skipped (the step stays pending until the server drops it; "
                        "%s)", self.job, self.rank, target, step, self._lead_advice())
        if due is None and local is None:
            return StepDecision()
        if blocked:
            log.warning("%s/%d: no snapshot of step %d: its state follows a non-finite loss",
                        self.job, self.rank, step)
            return StepDecision()
        meta: dict[str, Any] = {"reason": "health"}
        if due is None:
            meta["requested_by"] = self.rank
            return StepDecision(True, local, meta)
        if requested_by is not None:
            meta["requested_by"] = requested_by
        reply = self._heartbeat.last_reply if self._heartbeat is not None else None
        reason = reply.snapshot_reason if reply is not None and reply.snapshot_at == due else None
        return StepDecision(True, reason or "coordinated snapshot", meta)

    def _lead_advice(self) -> str:
        median = self.probe.status().signals.get("step_time_median_s")
        interval = self._heartbeat.interval if self._heartbeat is not None else None
        if (isinstance(median, int | float) and median > 0 and interval is not None):
            lead = math.ceil(2 * interval / float(median)) + 1
            return (f"steps take {float(median):.3g} s and heartbeats come every "
                    f"{interval:g} s: a snapshot lead of at least {lead} is needed")
        return "raise the server's --snapshot-lead"

    # -- the probe's actions (probe thread, or the loop's for a non-finite loss) ---------

    def _on_action(self, action: Action) -> None:
        if self._closed:
            return
        if action.kind == "rollback":
            request = self._submit_rollback(self._request_rollback, action)
            if request is not None:
                with self._lock:
                    self._local_rollback = (action.step, request)
        elif action.kind == "snapshot":
            if self.coordinated and not self._may_write:
                if not self._said_read_only:
                    self._said_read_only = True
                    log.warning("%s/%d: the policy asks for a snapshot (%s), but this token "
                                "may only read job %r: none is asked for", self.job, self.rank,
                                action.reason, self.job)
            elif self.coordinated:
                self._submit(self._request_snapshot, action)
            elif self.world_size == 1:
                with self._lock:
                    self._snapshot_next = action.reason
            else:
                log.warning("%s/%d: the policy asks for a snapshot (%s), but without a server "
                            "the %d ranks cannot be coordinated", self.job, self.rank,
                            action.reason, self.world_size)
        elif action.kind == "report_failing":
            self._failing = action.reason
            log.error("%s/%d: this rank is failing (%s): %s", self.job, self.rank,
                      action.state, action.reason)
            if self._heartbeat is not None:
                self._submit(self._heartbeat.beat_now)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any] | None:
        try:
            return self._worker.submit(self._guarded, fn, *args)
        except RuntimeError:  # shut down: the agent is closing
            return None

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # never into training: logged, and the loop goes on
            log.warning("%s/%d: health %s failed: %s", self.job, self.rank,
                        getattr(fn, "__name__", "request"), exc)
            return None

    def _request_snapshot(self, action: Action) -> None:
        assert self._server is not None and self._heartbeat is not None
        self._heartbeat.beat_now()  # so the server picks the target from this rank's step too
        try:
            # The job's pace now: the step that just slowed down is why a rank asks
            # (the policy acts on one step's ratio), and the server's heartbeats still
            # hold the pace from before. A one-off slow step then sets a target a few
            # steps ahead, which ranks may pass before they hear of it: the loop's
            # next save clears it.
            recent = self._loop_source.recent_step_time(1)
            pace = recent if recent is not None and 0 < recent <= 86400 else None
            doc = self._server.snapshot_request(self.job, self.rank, clip_reason(action.reason),
                                                step_time_s=pace)
        except CkptdError as exc:
            log.warning("%s/%d: snapshot request failed: [%s] %s", self.job, self.rank,
                        exc.code, exc.message)
            return
        target = doc.snapshot_at
        if doc.accepted:
            with self._lock:
                self._posted_target = target
                self._posted_at = time.time()
                self._requested_by[target] = self.rank
            log.warning("%s/%d: asked for a coordinated snapshot at step %d: %s",
                        self.job, self.rank, target, action.reason)
        else:
            log.info("%s/%d: snapshot request not accepted (a snapshot at step %d is pending "
                     "or was set too recently)", self.job, self.rank, target)

    # -- heartbeats (the heartbeat thread) ---------------------------------------------------

    def _health_json(self) -> dict[str, Any]:
        doc = self.probe.status().to_json()
        doc["reasons"] = [clip_reason(r) for r in doc["reasons"][:_MAX_REASONS]]
        signals = doc["signals"]
        if len(signals) > _MAX_SIGNALS:
            doc["signals"] = dict(list(signals.items())[:_MAX_SIGNALS])
        return doc

    def _on_beat(self, reply: HeartbeatReply | None, rtt_ms: float | None) -> None:
        if self._chained_on_beat is not None:
            try:
                self._chained_on_beat(reply, rtt_ms)
            except Exception as exc:
                log.debug("chained heartbeat listener failed: %s", exc)
        self.probe.record_rtt(rtt_ms if reply is not None else None)
        if reply is None or self._closed:
            return
        target = reply.snapshot_at
        with self._lock:
            lookup = (target is not None and target not in self._requested_by
                      and target not in self._looked_up)
            if lookup:
                assert target is not None
                self._looked_up.add(target)
        if lookup:
            assert target is not None
            self._submit(self._look_up_requester, target)

    def _look_up_requester(self, target: int) -> None:
        """Which rank asked for the snapshot at ``target`` (the event log says), so
        that every rank offers the commit the same ``meta``."""
        assert self._server is not None
        for event in reversed(self._server.events(self.job).events):
            if event.kind == "snapshot_requested" and event.step == target:
                if event.rank is not None:
                    with self._lock:
                        self._requested_by[target] = event.rank
                return


__all__ = ["HealthAgent", "StepDecision"]
