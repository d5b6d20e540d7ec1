"""Soft state: rank heartbeats, liveness, coordinated snapshot targets, events.

Everything here lives in the server's memory and is rebuilt by the clients'
heartbeats after a restart (within one interval). Durable markers (rollback) are
refs in the store; ``StoreViews`` (``store_views.py``, re-exported here) keeps
short-lived copies of them and of immutable documents so that a heartbeat does
not cost a store read.

Times: liveness is measured on the registry's monotonic clock (a wall clock that
jumps must not kill ranks); the unix time of each heartbeat is kept for display.

A little past the house's ~500 lines on purpose: liveness, targets and the soft
state's limits share one lock and one map of jobs, and read best side by side.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptd.errors import TooLarge, WorldSizeMismatch
from ckptd.server.launches import JobLaunches

# Its old home: server/app.py, deps.py, dashboard.py and tenancy.py import it from here.
from ckptd.server.store_views import StoreViews as StoreViews

log = logging.getLogger(__name__)

# "left": the rank said goodbye (it closed cleanly); "dead": it went silent.
RankState = Literal["alive", "degraded", "critical", "dead", "left"]
HealthState = Literal["ok", "degraded", "critical"]

_FROM_HEALTH: dict[str, RankState] = {"ok": "alive", "degraded": "degraded", "critical": "critical"}
# Listing order of peers in a restore plan: the healthiest first.
_PREFERENCE: dict[RankState, int] = {
    "alive": 0, "degraded": 1, "critical": 2, "dead": 3, "left": 4,
}

EVENTS_PER_JOB = 200


# The signal that says how many of a heartbeat's signals were dropped.
DROPPED_SIGNALS = "ckptd_signals_dropped"


def _clipped(health: dict[str, Any], limit: int) -> dict[str, Any]:
    """``health`` with its signals cut to ``limit`` bytes of names and values (in
    the order sent), and a count of those dropped."""
    signals = health.get("signals")
    if not isinstance(signals, dict):
        return health
    kept: dict[str, Any] = {}
    size = 0
    for name, value in signals.items():
        size += len(name) + (len(value) if isinstance(value, str) else 8)
        if size > limit:
            break
        kept[name] = value
    if len(kept) == len(signals):
        return health
    kept[DROPPED_SIGNALS] = len(signals) - len(kept)
    return {**health, "signals": kept}


def rank_state(
    now: float, last_heartbeat: float, health: str, *, interval: float, dead_after: int
) -> RankState:
    """A rank's state: ``dead`` once ``dead_after`` intervals passed without a
    heartbeat, else what its last heartbeat said of its health."""
    if now - last_heartbeat > interval * dead_after:
        return "dead"
    return _FROM_HEALTH.get(health, "alive")


@dataclass(slots=True)
class Heartbeat:
    """The last heartbeat of one rank."""

    rank: int
    world_size: int
    peer_url: str | None
    step: int | None
    held_step: int | None
    health: dict[str, Any]
    rtt_ms: float | None
    seen: float  # registry clock (monotonic)
    seen_wall: float  # unix time
    left: bool = False  # said goodbye: closed cleanly, not dead

    @property
    def health_state(self) -> str:
        return str(self.health.get("state", "ok"))


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank as the routes show it."""

    rank: int
    state: RankState
    step: int | None
    held_step: int | None
    peer_url: str | None
    last_heartbeat: float
    age_s: float
    health: dict[str, Any]
    rtt_ms: float | None


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened to a job: why a snapshot was asked for, a rollback."""

    at: float  # unix time
    kind: str
    rank: int | None = None
    step: int | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "kind": self.kind,
            "rank": self.rank,
            "step": self.step,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class SnapshotTarget:
    step: int
    reason: str
    requested_by: int | None
    set_at: float  # registry clock


@dataclass(frozen=True, slots=True)
class SnapshotDecision:
    """Answer to a snapshot request."""

    step: int
    reason: str
    accepted: bool


@dataclass(slots=True)
class _Fallback:
    """The older step ``GET latest`` last answered for a job, past damage: the step
    the ranks that asked go on to restore."""

    step: int
    reason: str
    said: set[int] = field(default_factory=set)  # ranks whose restore of it is an event


@dataclass(slots=True)
class _Job:
    world_size: int | None = None
    epoch: int = 0  # the newest timeline a heartbeat came with
    ranks: dict[int, Heartbeat] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)  # ranks whose death is in the event log
    target: SnapshotTarget | None = None
    last_target: SnapshotTarget | None = None
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=EVENTS_PER_JOB))
    touched: float = 0.0
    since: float = 0.0  # first heartbeat this server got (a new home after a failover)
    fallback: _Fallback | None = None
    launches: JobLaunches = field(default_factory=JobLaunches)  # (launches.py)


class Registry:
    """Heartbeats and coordination of every job this server has heard from."""

    def __init__(
        self,
        *,
        interval: float,
        dead_after: int,
        snapshot_lead: int,
        snapshot_min_interval: float,
        snapshot_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        max_jobs: int = 4096,
        max_ranks: int = 65536,
        signal_bytes: int = 16 << 10,
    ) -> None:
        self.interval = interval
        # Soft state is bounded: jobs, ranks (all jobs together) and each rank's signals.
        self.max_jobs = max_jobs
        self.max_ranks = max_ranks
        self.signal_bytes = signal_bytes
        self.dead_after = dead_after
        self.snapshot_lead = snapshot_lead
        self.snapshot_min_interval = snapshot_min_interval
        self.snapshot_timeout = snapshot_timeout
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._swept = clock()
        # A rank unheard of this long is forgotten (and a job with nothing left).
        self.forget_after = max(3600.0, 100 * interval * dead_after)

    @property
    def dead_window(self) -> float:
        return self.interval * self.dead_after

    # -- heartbeats ---------------------------------------------------------------

    def heartbeat(
        self,
        job: str,
        rank: int,
        *,
        world_size: int,
        peer_url: str | None = None,
        step: int | None = None,
        held_step: int | None = None,
        health: dict[str, Any] | None = None,
        rtt_ms: float | None = None,
        epoch: int = 0,
        launch: str | None = None,
        host: str | None = None,
    ) -> str | None:
        """Records a heartbeat. A world size other than the job's is refused
        (``WorldSizeMismatch``) unless it comes with a newer timeline (``epoch``)
        or no other rank of the old world is alive: one rank must not drop live
        ranks from restore plans and status. Returns a warning when another
        ``launch`` of the job is live at once (``launches.py``), else None."""
        now = self._clock()
        health = _clipped(health, self.signal_bytes) if health is not None else None
        with self._lock:
            self._sweep(now)
            self._check_room(job, rank)
            j = self._jobs.setdefault(job, _Job(since=now))
            conflict = None
            if launch is not None:  # before the world size: a refused launch is live too
                conflict, news = j.launches.beat(job, launch, rank, host, now,
                                                 interval=self.interval,
                                                 forget_after=self.dead_window)
                for text in news:
                    log.warning("%s", text)
                    j.events.append(Event(self._wall(), "launch_conflict", rank=rank,
                                          reason=text[:1024]))
            if j.world_size is not None and j.world_size != world_size and epoch <= j.epoch:
                # A rank that said goodbye is gone too: it never turns dead.
                live = [b.rank for b in j.ranks.values()
                        if b.rank != rank and self._state(now, b) not in ("dead", "left")]
                if live:
                    raise WorldSizeMismatch(
                        f"job {job} has world size {j.world_size} with live ranks; world size "
                        f"{world_size} needs a new timeline (a rollback) or the old ranks gone"
                        + (f"; {conflict}" if conflict else ""),
                        job=job, world_size=j.world_size, asked=world_size,
                    )
            j.epoch = max(j.epoch, epoch)
            if j.world_size != world_size:
                # A restarted job with another world size: ranks past it are gone.
                j.world_size = world_size
                for r in [r for r in j.ranks if r >= world_size]:
                    del j.ranks[r]
                    j.dead.discard(r)
            if rank in j.dead:
                j.dead.discard(rank)
                j.events.append(Event(self._wall(), "rank_back", rank=rank, step=step))
            j.ranks[rank] = Heartbeat(
                rank=rank,
                world_size=world_size,
                peer_url=peer_url,
                step=step,
                held_step=held_step,
                health=dict(health or {"state": "ok", "reasons": [], "signals": {}}),
                rtt_ms=rtt_ms,
                seen=now,
                seen_wall=self._wall(),
            )
            j.touched = now
            return conflict

    def _check_room(self, job: str, rank: int) -> None:
        # Under the lock. Refuses a job or a rank this server does not know yet once
        # it keeps as many as it may; those it knows keep beating.
        j = self._jobs.get(job)
        if j is None and len(self._jobs) >= self.max_jobs:
            raise TooLarge(f"this server keeps the heartbeats of {self.max_jobs} jobs "
                           "already (CKPTD_HEARTBEAT_MAX_JOBS)", limit=self.max_jobs)
        if (j is None or rank not in j.ranks) and sum(
                len(o.ranks) for o in self._jobs.values()) >= self.max_ranks:
            raise TooLarge(f"this server keeps the heartbeats of {self.max_ranks} ranks "
                           "already (CKPTD_HEARTBEAT_MAX_RANKS)", limit=self.max_ranks)

    def goodbye(self, job: str, rank: int, *, step: int | None = None) -> bool:
        """The rank closed cleanly: it shows as ``left`` (never ``dead``) until it
        beats again. False when this server never heard of it."""
        with self._lock:
            j = self._jobs.get(job)
            beat = j.ranks.get(rank) if j is not None else None
            if j is None or beat is None:
                return False
            if not beat.left:
                beat.left = True
                j.dead.discard(rank)
                j.events.append(Event(self._wall(), "rank_left", rank=rank,
                                      step=beat.step if step is None else step,
                                      reason="closed"))
            j.touched = self._clock()
            return True

    def _state(self, now: float, beat: Heartbeat) -> RankState:
        if beat.left:
            return "left"
        return rank_state(
            now, beat.seen, beat.health_state, interval=self.interval, dead_after=self.dead_after
        )

    def ranks(self, job: str) -> tuple[int | None, list[RankView]]:
        """The job's world size (as its ranks last said) and its ranks, by rank."""
        now = self._clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None, []
            views = []
            for rank in sorted(j.ranks):
                beat = j.ranks[rank]
                state = self._state(now, beat)
                self._note_death(j, beat, state)
                views.append(
                    RankView(
                        rank=rank,
                        state=state,
                        step=beat.step,
                        held_step=beat.held_step,
                        peer_url=beat.peer_url,
                        last_heartbeat=beat.seen_wall,
                        age_s=round(max(0.0, now - beat.seen), 3),
                        health=beat.health,
                        rtt_ms=beat.rtt_ms,
                    )
                )
            return j.world_size, views

    def rebuilding(self, job: str) -> bool:
        """True while this server gathers the job's ranks anew: it first heard of the
        job less than a dead window ago (it just became the job's home, after a
        failover or a restart) and not every rank has beaten yet."""
        now = self._clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is None or j.world_size is None:
                return False
            return now - j.since < self.dead_window and len(j.ranks) < j.world_size

    def _note_death(self, j: _Job, beat: Heartbeat, state: RankState) -> None:
        # Deaths are noticed when someone looks (a listing, a scrape, a plan):
        # the event carries the time the rank went silent past the window.
        if state == "dead" and beat.rank not in j.dead:
            j.dead.add(beat.rank)
            j.events.append(
                Event(
                    beat.seen_wall + self.dead_window,
                    "rank_dead",
                    rank=beat.rank,
                    step=beat.step,
                    reason=f"no heartbeat for {self.dead_after} intervals",
                )
            )

    def state_counts(self) -> dict[str, dict[RankState, int]]:
        """Per job, how many ranks are in each state (for /metrics)."""
        now = self._clock()
        counts: dict[str, dict[RankState, int]] = {}
        with self._lock:
            for name, j in self._jobs.items():
                c: dict[RankState, int] = {
                    "alive": 0, "degraded": 0, "critical": 0, "dead": 0, "left": 0,
                }
                for beat in j.ranks.values():
                    state = self._state(now, beat)
                    self._note_death(j, beat, state)
                    c[state] += 1
                counts[name] = c
        return counts

    def snapshot_failures(self) -> dict[str, int]:
        """Per job, the failed snapshots its live ranks reported (for /metrics)."""
        out: dict[str, int] = {}
        with self._lock:
            for name, j in self._jobs.items():
                total = 0
                for beat in j.ranks.values():
                    n = (beat.health.get("signals") or {}).get("snapshot_failures")
                    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                        total += n
                out[name] = total
        return out

    def peers_holding(self, job: str, step: int, exclude: int) -> list[tuple[int, str]]:
        """Live ranks other than ``exclude`` that hold ``step`` in their pools and
        serve it at a peer URL, healthiest first, then in ring order from
        ``exclude`` (so that restoring ranks spread over the peers)."""
        now = self._clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return []
            world = j.world_size or 1
            found = []
            for beat in j.ranks.values():
                if beat.rank == exclude or beat.held_step != step or not beat.peer_url:
                    continue
                state = self._state(now, beat)
                if state in ("dead", "left"):
                    continue
                found.append(
                    (_PREFERENCE[state], (beat.rank - exclude) % world, beat.rank, beat.peer_url)
                )
        found.sort()
        return [(rank, url) for _, _, rank, url in found]

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    # -- coordinated snapshots ------------------------------------------------------

    def request_snapshot(
        self, job: str, rank: int, reason: str, latest: int | None, pace: float | None = None
    ) -> SnapshotDecision:
        """Sets a snapshot target ``snapshot_lead`` steps past the fastest live rank,
        unless one is pending or one was set less than ``snapshot_min_interval`` ago.
        ``pace``: the asking rank's latest step time (see ``_lead``)."""
        now = self._clock()
        with self._lock:
            j = self._jobs.setdefault(job, _Job(touched=now))
            j.touched = now
            self._settle(j, latest, now)
            if j.target is not None:
                return SnapshotDecision(j.target.step, j.target.reason, accepted=False)
            last = j.last_target
            if last is not None and now - last.set_at < self.snapshot_min_interval:
                return SnapshotDecision(last.step, last.reason, accepted=False)
            live = [b for b in j.ranks.values() if self._state(now, b) not in ("dead", "left")]
            steps = [b.step for b in live if b.step is not None]
            base = max(steps) if steps else (latest if latest is not None else 0)
            if latest is not None:
                base = max(base, latest)
            target = SnapshotTarget(base + self._lead(live, pace), reason, rank, now)
            j.target = j.last_target = target
            j.events.append(
                Event(
                    self._wall(), "snapshot_requested", rank=rank, step=target.step, reason=reason
                )
            )
            log.info(
                "%s: snapshot at step %d asked by rank %d (%s)", job, target.step, rank, reason
            )
            return SnapshotDecision(target.step, reason, accepted=True)

    def _lead(self, live: list[Heartbeat], pace: float | None = None) -> int:
        """Steps between the fastest rank and the target: at least the configured
        lead, and enough that every rank hears of the target (a heartbeat or two)
        before its loop gets there, judged by the fastest median step time ranks
        report, or by ``pace``, the asking rank's latest step time, when that is
        slower: the ranks of a job step together, and a rank asks because steps just
        slowed down (a slow node), which heartbeats' medians show only much later (a
        target set by the old pace lay 90 steps and 105 s ahead of a slowed job)."""
        times = [
            t
            for b in live
            if isinstance(t := b.health.get("signals", {}).get("step_time_median_s"), int | float)
            and not isinstance(t, bool)
            and t > 0
        ]
        if not times:
            return self.snapshot_lead
        if pace is not None and pace > 0:  # a slower pace only: it never lengthens the lead
            times = [max(min(times), pace)]
        return max(self.snapshot_lead, math.ceil(2 * self.interval / min(times)) + 1)

    def pending_target(self, job: str, latest: int | None) -> SnapshotTarget | None:
        """The job's snapshot target, unless a commit at or after it exists
        (``latest`` >= target) or it is older than ``snapshot_timeout``."""
        now = self._clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            self._settle(j, latest, now)
            return j.target

    def has_target(self, job: str) -> bool:
        with self._lock:
            j = self._jobs.get(job)
            return j is not None and j.target is not None

    def note_commit(self, job: str, step: int) -> None:
        """A step committed (through this server): a target at or before it is done."""
        with self._lock:
            j = self._jobs.get(job)
            if j is not None:
                self._settle(j, step, self._clock())

    def drop_target(self, job: str, reason: str) -> None:
        """Drops the job's pending snapshot target: a rollback sends every rank back
        before it, and what some saved of it belongs to the ended timeline."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None or j.target is None:
                return
            target, j.target = j.target, None
            j.events.append(Event(self._wall(), "snapshot_dropped", step=target.step,
                                  reason=reason))

    def _settle(self, j: _Job, latest: int | None, now: float) -> None:
        target = j.target
        if target is None:
            return
        if latest is not None and latest >= target.step:
            j.target = None
            j.events.append(
                Event(self._wall(), "snapshot_committed", step=latest, reason=target.reason)
            )
        elif now - target.set_at > self.snapshot_timeout:
            j.target = None
            j.events.append(
                Event(
                    self._wall(),
                    "snapshot_expired",
                    step=target.step,
                    reason=f"no commit at or after it within {self.snapshot_timeout:g} s",
                )
            )

    # -- events ---------------------------------------------------------------------

    def add_event(
        self, job: str, kind: str, *, rank: int | None = None, step: int | None = None,
        reason: str = "",
    ) -> None:
        with self._lock:
            j = self._jobs.setdefault(job, _Job(touched=self._clock()))
            j.events.append(Event(self._wall(), kind, rank=rank, step=step, reason=reason))

    def note_latest(self, job: str, step: int, problems: list[str]) -> None:
        """What a restore of "latest" gets now: ``step``, older than the ref when
        ``problems`` say why. Asking restores nothing: ``restoring`` says the event."""
        with self._lock:
            j = self._jobs.get(job)
            if problems:
                j = j or self._jobs.setdefault(job, _Job(touched=self._clock()))
                j.fallback = _Fallback(step, "; ".join(problems)[:1024])
            elif j is not None:
                j.fallback = None

    def restoring(self, job: str, step: int, rank: int) -> None:
        """``rank`` reads ``step`` of ``job`` to restore it: a ``restore_fallback``
        event when that is the step latest fell back to (once per rank and answer)."""
        with self._lock:
            j = self._jobs.get(job)
            fallback = j.fallback if j is not None else None
            if j is None or fallback is None or fallback.step != step or rank in fallback.said:
                return
            fallback.said.add(rank)
            j.events.append(Event(self._wall(), "restore_fallback", rank=rank, step=step,
                                  reason=fallback.reason))

    def events(self, job: str) -> list[Event]:
        """The job's events, oldest first."""
        with self._lock:
            j = self._jobs.get(job)
            return sorted(j.events, key=lambda e: e.at) if j is not None else []

    # -- housekeeping ---------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        # Under the lock. Now and then, forget what nobody has said for a long time,
        # so that memory does not grow with every job ever seen.
        if now - self._swept < 60.0:
            return
        self._swept = now
        for name in list(self._jobs):
            j = self._jobs[name]
            for r in [r for r, b in j.ranks.items() if now - b.seen > self.forget_after]:
                del j.ranks[r]
                j.dead.discard(r)
            if not j.ranks and j.target is None and now - j.touched > self.forget_after:
                del self._jobs[name]
