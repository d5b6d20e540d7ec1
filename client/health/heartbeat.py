"""Heartbeats: a rank tells the server, every few seconds, that it is alive, where
its peer chunk server is, the step its loop is at, the committed step whose
chunks it holds, and its health (``POST /v1/jobs/{job}/ranks/{rank}/heartbeat``).

The server keeps these as soft state, so a heartbeat is simply sent again until one
gets through: errors are logged (once per kind of trouble, then at debug) and
retried at the next interval, never raised into training. A refused token (401 or
403: revoked while the job runs) is tried again only every ``REFUSED_INTERVAL_S``
until it is accepted: asking every few seconds changes nothing until an operator
grants it again. The reply's
``interval_s`` sets the next interval; the reply itself (a coordinated
``snapshot_at``, a ``rollback_to``) is kept in ``last_reply`` for the health probe.

A step this rank saved whose commit was still pending when its own upload finished
(other ranks were not in yet) is checked once per beat until it committed; then
``on_committed`` runs (the checkpointer publishes the pool's chunks to peers) and it
becomes the ``held_step``.

Each beat names this rank's launch (``launch``): when ranks of another launch of the
job beat at the same time, the reply says so (``launch_conflict``: two jobs with one
name, or a rank of an old launch still running), and it is logged at WARNING, once
and then at most once a minute while it lasts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ckptd import api, knobs
from ckptd.cluster import loopback_host
from ckptd.errors import (
    CkptdError,
    Forbidden,
    InvalidRequest,
    Timeout,
    Unauthorized,
    Unavailable,
)
from ckptd.format import check_job, check_step

from ..launch import heartbeat_launch
from ..transport_http import SyncTransport

log = logging.getLogger(__name__)

HealthFn = Callable[[], dict[str, Any]]

_MIN_INTERVAL = 0.05
_MAX_INTERVAL = 3600.0
# Between two beats while the server refuses the token.
REFUSED_INTERVAL_S = 60.0
# Pauses before each resend of a beat lost on the way (``Heartbeat._send``).
_RESEND_PAUSES = (0.0, 0.2)
# Seconds a heartbeat sends no launch id after a server refused the field (older).
LAUNCH_RETRY_S = 600.0

# A launch conflict the replies keep naming is logged again at most this often.
CONFLICT_REPEAT_S = 60.0


def default_health() -> dict[str, Any]:
    return {"state": "ok", "reasons": [], "signals": {}}


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """The server's answer to one heartbeat."""

    interval_s: float
    snapshot_at: int | None
    snapshot_reason: str | None
    rollback_to: int | None
    received_at: float  # time.time() when it arrived
    rtt_ms: float
    rollback_epoch: int = 0  # the job's timeline (rollbacks so far)
    peer_token: str | None = None  # the job's peer token (peer servers require it)
    peer_url_refused: str | None = None  # why the server did not register peer_url
    launch_conflict: str | None = None  # another launch of the job beats at once

    @classmethod
    def parse(cls, doc: api.HeartbeatReply, rtt_ms: float,
              fallback_interval: float) -> HeartbeatReply:
        """The server's answer (read with the API's model) as this rank keeps it."""
        interval = doc.interval_s
        if not (math.isfinite(interval) and interval > 0):
            interval = fallback_interval
        return cls(
            interval_s=float(interval),
            snapshot_at=doc.snapshot_at,
            snapshot_reason=doc.snapshot_reason,
            rollback_to=doc.rollback_to,
            received_at=time.time(),
            rtt_ms=rtt_ms,
            rollback_epoch=doc.rollback_epoch,
            peer_token=doc.peer_token,
            peer_url_refused=doc.peer_url_refused,
            launch_conflict=doc.launch_conflict,
        )


class Heartbeat:
    """Sends this rank's heartbeats on a daemon thread (``start``), or one now
    (``beat_now``). Setters (``note_step``, ``set_held_step``, ...) only record; the
    next beat carries them."""

    def __init__(
        self,
        url: str,
        job: str,
        rank: int,
        world_size: int,
        token: str | None = None,
        *,
        interval: float | None = None,
        peer_url: str | None = None,
        health: HealthFn | None = None,
        timeout: float | None = None,
        on_beat: Callable[[HeartbeatReply | None, float | None], None] | None = None,
        send: bool = True,
        launch: str | Callable[[], str | None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.job = check_job(job)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.interval = knobs.heartbeat_interval() if interval is None else float(interval)
        self._fixed_interval = interval is not None
        self.peer_url = peer_url
        self.health: HealthFn = health or default_health
        # Called after every beat with the reply (None: it failed) and its round trip
        # in ms (None when no answer came): the health probe's round-trip signal.
        self.on_beat = on_beat
        # Called with the job's peer token when a reply brings a new one.
        self.on_peer_token: Callable[[str], None] | None = None
        self._peer_url_refused: str | None = None
        # This rank's launch id, asked at every beat (the group's may come later);
        # not given: the one the environment or the process group names.
        if isinstance(launch, str):
            self.launch: Callable[[], str | None] = lambda: launch
        else:
            self.launch = heartbeat_launch() if launch is None else launch
        self._launch_off_until = 0.0  # (monotonic) a server older than the field
        self._conflict_said: float | None = None  # time.monotonic() of the last warning
        self._in_conflict = False  # the last reply named a launch conflict
        timeout = min(10.0, max(1.0, self.interval * 2)) if timeout is None else timeout
        # No retries with backoff: a heartbeat that does not get through is sent again
        # at the next interval anyway. One lost on the way is resent at once (beat_now).
        self.transport = SyncTransport(self.url, token, timeout=timeout, retries=0)
        self._step: int | None = None
        self._held_step: int | None = None
        self._pending: tuple[int, Callable[[int], None] | None] | None = None
        self._rtt_ms: float | None = None
        self._last_reply: HeartbeatReply | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._complained: set[str] = set()
        self.beats = 0  # heartbeats the server accepted
        self.failures = 0  # heartbeats that did not get through
        self.refused = False  # the last beat's token was refused (401/403)
        # Snapshots of this rank that failed, and the last one's error: carried in
        # the health report (a signal and a reason), so status, the dashboard and
        # /metrics show them without a field of their own.
        self.snapshot_failures = 0
        self.snapshot_error: str | None = None
        if not send:
            # A rank whose token may only read the job (heartbeats need write): stopped
            # from the start, so that nothing is ever sent (no beat, no goodbye) while
            # the health agent and the peer service hold it as any other.
            self._stop.set()

    def __repr__(self) -> str:
        return (f"<Heartbeat {self.url} {self.job}/{self.rank} every {self.interval:g} s, "
                f"{self.beats} sent, {self.failures} failed>")

    # -- what the next beat says -------------------------------------------------------

    def note_step(self, step: int) -> None:
        """The training loop's current step."""
        self._step = check_step(step)

    @property
    def step(self) -> int | None:
        return self._step

    def set_held_step(self, step: int | None, *, wake: bool = True) -> None:
        """The committed step whose chunks this rank's pool holds and serves (None:
        none). ``wake`` sends the news at once instead of at the next interval."""
        self._held_step = None if step is None else check_step(step)
        if self._pending is not None and step is not None and self._pending[0] <= step:
            self._pending = None
        if wake:
            self._wake.set()

    @property
    def held_step(self) -> int | None:
        return self._held_step

    def hold_when_committed(self, step: int, on_committed: Callable[[int], None] | None) -> None:
        """``step`` is staged and uploaded but not yet committed: each beat checks,
        and once it committed ``on_committed(step)`` runs and it is the held step."""
        self._pending = (check_step(step), on_committed)
        self._wake.set()

    def note_snapshot_failure(self, message: str) -> None:
        """A snapshot of this rank failed; the next beat (sent now) says so."""
        self.snapshot_failures += 1
        self.snapshot_error = message[:1000]
        self._wake.set()

    def set_peer_url(self, url: str | None) -> None:
        self.peer_url = url
        self._wake.set()

    @property
    def last_reply(self) -> HeartbeatReply | None:
        """The server's last answer (``snapshot_at``, ``rollback_to``, ...)."""
        return self._last_reply

    @property
    def rtt_ms(self) -> float | None:
        """Round trip of the last heartbeat, in milliseconds."""
        return self._rtt_ms

    # -- sending -------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        try:
            health = self.health()
        except Exception as exc:  # a broken probe must not stop heartbeats
            self._complain("health", "health callback failed: %s", exc)
            health = default_health()
        if self.snapshot_failures:
            health = dict(health)
            health["signals"] = {**(health.get("signals") or {}),
                                 "snapshot_failures": self.snapshot_failures}
            reasons = list(health.get("reasons") or [])[:63]
            health["reasons"] = [*reasons, self.snapshot_error or "a snapshot failed"]
        body: dict[str, Any] = {
            "world_size": self.world_size,
            "peer_url": self.peer_url,
            "step": self._step,
            "held_step": self._held_step,
            "health": health,
            "rtt_ms": None if self._rtt_ms is None else round(self._rtt_ms, 3),
        }
        launch = self._launch() if time.monotonic() >= self._launch_off_until else None
        if launch is not None:
            body["launch"] = launch  # (left out, not null: older servers refuse the name)
        return body

    def _launch(self) -> str | None:
        try:
            launch = self.launch()
        except Exception as exc:  # a broken source must not stop heartbeats
            self._complain("launch", "cannot tell this rank's launch: %s", exc)
            return None
        return launch if isinstance(launch, str) and 0 < len(launch) <= 256 else None

    def beat_now(self) -> HeartbeatReply | None:
        """Sends one heartbeat from the calling thread; the reply, or None when it
        did not get through (logged) or the heartbeat is stopped."""
        with self._send_lock:
            if self._stop.is_set():
                return None
            self._check_pending()
            body = self.body()
            t0 = time.perf_counter()
            try:
                answer, t0 = self._send_any_server(body)
            except CkptdError as exc:
                self.failures += 1
                self.refused = isinstance(exc, Unauthorized | Forbidden)
                # An answer that came (a refusal) still measured the round trip.
                rtt: float | None = None
                if not isinstance(exc, Unavailable | Timeout):
                    rtt = self._rtt_ms = (time.perf_counter() - t0) * 1000.0
                self._complain(exc.code, "heartbeat to %s failed: [%s] %s%s", self.url,
                               exc.code, exc.message,
                               f" (sent again every {REFUSED_INTERVAL_S:g} s until the token "
                               "is accepted)" if self.refused else "")
                self._notify(None, rtt)
                return None
            rtt = (time.perf_counter() - t0) * 1000.0
            self._rtt_ms = rtt
            self.refused = False
            reply = HeartbeatReply.parse(answer, rtt, self.interval)
            self._last_reply = reply
            if reply.peer_token and self.on_peer_token is not None:
                try:
                    self.on_peer_token(reply.peer_token)
                except Exception as exc:  # a listener must not stop heartbeats
                    self._complain("peer_token", "peer token listener failed: %s", exc)
            if not self._fixed_interval:
                self.interval = min(_MAX_INTERVAL, max(_MIN_INTERVAL, reply.interval_s))
            self.beats += 1
            if self._complained:
                log.info("heartbeats to %s get through again", self.url)
                self._complained.clear()
            if reply.peer_url_refused and not self._peer_url_refused:
                log.warning("%s/%d: the server did not register peer URL %s: %s (%s)",
                            self.job, self.rank, self.peer_url, reply.peer_url_refused,
                            _peer_url_hint(self.peer_url))
            self._peer_url_refused = reply.peer_url_refused
            self._say_conflict(reply.launch_conflict)
            self._notify(reply, rtt)
            return reply

    def _say_conflict(self, conflict: str | None) -> None:
        """Logs a launch conflict a reply named: once, then at most once a minute."""
        if conflict is None:
            if self._in_conflict:
                log.info("%s/%d: no other launch of job %s beats at the same time any more",
                         self.job, self.rank, self.job)
            self._in_conflict = False
            return
        self._in_conflict = True
        # (a conflict that comes and goes with a late beat is said once a minute too)
        now = time.monotonic()
        if self._conflict_said is None or now - self._conflict_said >= CONFLICT_REPEAT_S:
            self._conflict_said = now
            log.warning("%s/%d: %s", self.job, self.rank, conflict)

    def _send_any_server(self, body: dict[str, Any]) -> tuple[Any, float]:
        """``_send``; a server older than the ``launch`` field refuses it (400): the
        beat goes again without it, and so do the next ones once that got through."""
        try:
            return self._send(body)
        except InvalidRequest:
            if "launch" not in body:
                raise
        answer = self._send({k: v for k, v in body.items() if k != "launch"})
        # (asked again later: a rolling upgrade's older replica answered this one)
        self._launch_off_until = time.monotonic() + LAUNCH_RETRY_S
        log.info("%s/%d: the server at %s takes no launch id in heartbeats (an older "
                 "ckptd): two launches of this job at once go unnoticed for %.0f s",
                 self.job, self.rank, self.url, LAUNCH_RETRY_S)
        return answer

    def _send(self, body: dict[str, Any]) -> tuple[Any, float]:
        """One beat; one lost mid-way (its replica died under it, or dropped the
        pooled connection) is sent again at once, and once more a moment later (a
        replica that is dying still takes connections while it closes them). Each
        resend connects afresh: a dead replica refuses it and routing takes it to the
        next one, where it would otherwise wait a whole interval (the job's liveness
        with it). A beat that timed out is not resent: it took its timeout already.
        The answer, and when the try that got it began (its round trip's start)."""
        for pause in _RESEND_PAUSES:
            t0 = time.perf_counter()
            try:
                return self.transport.heartbeat(self.job, self.rank, body), t0
            except Unavailable:
                if self._stop.wait(pause):
                    raise
        t0 = time.perf_counter()
        return self.transport.heartbeat(self.job, self.rank, body), t0

    def _notify(self, reply: HeartbeatReply | None, rtt: float | None) -> None:
        if self.on_beat is None:
            return
        try:
            self.on_beat(reply, rtt)
        except Exception as exc:  # a listener must not stop heartbeats
            self._complain("listener", "heartbeat listener failed: %s", exc)

    def _check_pending(self) -> None:
        pending = self._pending
        if pending is None:
            return
        step, callback = pending
        try:
            self.transport.read_commit(self.job, step)
        except (Unavailable, Timeout) as exc:
            self._complain("pending", "cannot ask whether step %d committed: %s", step, exc)
            return
        except CkptdError:
            return  # 409 not_committed: ask again next time
        if self._pending != pending:
            return  # replaced meanwhile (a newer save)
        try:
            if callback is not None:
                callback(step)
        except Exception as exc:
            log.warning("%s/%d: publishing step %d to peers failed: %s", self.job, self.rank,
                        step, exc)
            self._pending = None
            return
        self._pending = None
        self._held_step = step

    def _complain(self, kind: str, msg: str, *args: Any) -> None:
        if kind in self._complained:
            log.debug(msg, *args)
        else:
            self._complained.add(kind)
            log.warning(msg, *args)

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> Heartbeat:
        """Starts the heartbeat thread (the first beat goes at once). Idempotent; none
        once stopped."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name=f"ckptd-heartbeat-"
                                            f"{self.job}-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat_now()
            except Exception as exc:  # never let the thread die
                self._complain("internal", "heartbeat failed unexpectedly: %s", exc)
            if not self.refused:
                self._wake.wait(self.interval)
                self._wake.clear()
                continue
            # Refused: news (a held step, a failed snapshot) waits too; stop does not.
            until = time.monotonic() + REFUSED_INTERVAL_S
            while not self._stop.is_set() and (left := until - time.monotonic()) > 0:
                self._wake.wait(left)
                self._wake.clear()

    def stop(self, timeout: float = 5.0, *, goodbye: bool = False) -> None:
        """Stops the thread and closes the connection. Idempotent. ``goodbye`` tells
        the server this rank closed cleanly (it shows ``left``, not ``dead``); a
        heartbeat stopped before without one stays silent, as a dead rank would."""
        stopped_before = self._stop.is_set()
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        with self._send_lock:
            if goodbye and not stopped_before:
                try:
                    self.transport.goodbye(self.job, self.rank, timeout=min(2.0, timeout))
                except CkptdError as exc:
                    log.debug("goodbye to %s failed: %s", self.url, exc)
            self.transport.close()


def _peer_url_hint(url: str | None) -> str:
    """What to do about a refused peer URL: a loopback one is no address of another
    host, so the server's networks must not take it."""
    if loopback_host(urlsplit(url or "").hostname or ""):
        return ("this rank's peer server listens on loopback only, so other hosts cannot "
                "reach it: bind it to an address they reach (CKPTD_PEER_HOST) or advertise "
                "one (CKPTD_PEER_ADVERTISE_HOST)")
    return "set CKPTD_PEER_ADVERTISE_HOST, or CKPTD_PEER_NETWORKS on the server"


__all__ = ["Heartbeat", "HeartbeatReply", "default_health"]


# The longest text the server takes in a heartbeat's health or a request's reason
# (ckptd.api: Reason, HealthReport).
MAX_REASON_TEXT = 1024


def clip_reason(text: str) -> str:
    """``text`` cut to ``MAX_REASON_TEXT`` characters, marked with "..." when cut."""
    return text if len(text) <= MAX_REASON_TEXT else text[: MAX_REASON_TEXT - 3] + "..."
