"""The health probe: a background thread that reads the GPU, the host, the training
loop and the round trip to the server, evaluates the policy and asks for actions.

Each kind of reading sits behind one small interface, ``ReadingSource``
(``readings.py``; the GPU's in ``nvml.py``):

- ``NvmlSource``: GPU signals through nvidia-ml-py; every GPU signal reads
  ``"unavailable"`` where NVML or a GPU is absent, and it never raises.
- ``HostSource``: memory, swap, CPU and free disk space through psutil.
- ``LoopSource``: fed by ``record_step(step, loss)``; step times, the rolling
  median, seconds since the last step (measured when read, so the probe thread
  sees a loop that stopped calling it), and a non-finite loss.
- ``RttSource``: fed by ``record_rtt(ms)`` from heartbeats.
- ``ScriptedSource``: replays readings, for tests and for trying a policy.

``HealthProbe`` reads every source each interval, keeps the latest
``HealthStatus`` for heartbeats, and calls ``on_action`` with ``Action``\\ s:
``snapshot`` (at most once per ``snapshot_min_interval_s``, and only for causes
not already asked for), ``report_failing``, and ``rollback`` when the loss turns
non-finite (never ``snapshot`` while it is).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ckptd.errors import InvalidRequest

from .nvml import NvmlSource
from .policy import (
    ACTION_NAMES,
    MAX_PROBE_INTERVAL_S,
    ActionName,
    Evaluation,
    Level,
    Policy,
    SignalValue,
    default_policy,
)
from .readings import (
    Clock,
    HostSource,
    LoopSource,
    Reading,
    ReadingSource,
    RttSource,
    S,
)

log = logging.getLogger(__name__)


# -- the probe --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Action:
    """Something the policy asks the Checkpointer to do.

    ``kind``: ``snapshot`` (ask the server for a coordinated snapshot),
    ``report_failing`` (report the rank as failing) or ``rollback`` (the job
    must go back to its last committed step; ``step`` is the step whose loss was
    non-finite).
    """

    kind: ActionName
    reason: str
    state: Level
    step: int | None = None


def _json_value(value: SignalValue) -> SignalValue:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@dataclass(frozen=True, slots=True)
class HealthStatus:
    """The latest verdict, as a heartbeat carries it."""

    state: Level = "ok"
    reasons: tuple[str, ...] = ()
    signals: Mapping[str, SignalValue] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The heartbeat's ``health`` object (non-finite numbers become strings)."""
        return {
            "state": self.state,
            "reasons": list(self.reasons),
            "signals": {k: _json_value(v) for k, v in self.signals.items()},
        }


class HealthProbe:
    """Reads every source each ``interval_s`` on a daemon thread, evaluates
    ``policy``, keeps ``status()`` for heartbeats and calls ``on_action``.

    ``on_action`` runs on the probe thread, or on the caller's thread for
    ``evaluate_now`` and for a non-finite loss passed to ``record_step``. ``rollback``
    runs on the caller's thread only (never the probe thread's), so it is asked for
    before the ``record_step`` that passed the loss returns. It should hand slow
    work (HTTP) elsewhere: the probe's next reading waits for it. What it raises
    is logged and dropped.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        sources: Iterable[ReadingSource] = (),
        interval_s: float | None = None,
        on_action: Callable[[Action], None] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.policy = policy if policy is not None else default_policy()
        self.sources: tuple[ReadingSource, ...] = tuple(sources)
        self.interval_s = float(interval_s if interval_s is not None
                                else self.policy.probe.interval_s)
        if not 0 < self.interval_s <= MAX_PROBE_INTERVAL_S:
            raise InvalidRequest(f"HealthProbe: interval_s must be > 0 and <= "
                                 f"{MAX_PROBE_INTERVAL_S:g}, not {self.interval_s:g}")
        self._on_action = on_action
        self._clock = clock
        self._lock = threading.Lock()  # guards _status
        self._evaluating = threading.RLock()  # one evaluation (and its actions) at a time
        self._status = HealthStatus()
        self._evaluation: Evaluation | None = None
        self._readings: dict[int, Reading] = {}
        self._errors: dict[int, str] = {}
        self._acked: dict[ActionName, set[str]] = {}
        self._last_snapshot_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the Checkpointer feeds in -----------------------------------------------

    def _source(self, kind: type[S]) -> S:
        for source in self.sources:
            if isinstance(source, kind):
                return source
        raise InvalidRequest(f"HealthProbe has no {kind.__name__} among its sources")

    def record_step(self, step: int, loss: float | None = None) -> None:
        """Pass one step (and its loss) to the ``LoopSource``; a non-finite loss is
        evaluated at once, so ``rollback`` reaches ``on_action`` before this returns."""
        loop = self._source(LoopSource)
        if not loop.record_step(step, loss):
            self._evaluate([loop])

    def exclude_from_step(self, seconds: float) -> None:
        """``seconds`` the loop spent waiting in ckptd (``LoopSource.exclude``); a
        probe without a ``LoopSource`` times no steps."""
        for source in self.sources:
            if isinstance(source, LoopSource):
                source.exclude(seconds)
                return

    def record_rtt(self, ms: float | None) -> None:
        """Pass one heartbeat's round trip (None: it failed) to the ``RttSource``."""
        self._source(RttSource).record_rtt(ms)

    def reset_loop(self) -> None:
        """After a restore or rollback: forget step timings and the non-finite loss."""
        loop = self._source(LoopSource)
        loop.reset()
        self._evaluate([loop])

    @property
    def nonfinite_step(self) -> int | None:
        """The step whose loss was non-finite, until ``reset_loop``; never save then."""
        for source in self.sources:
            if isinstance(source, LoopSource):
                return source.nonfinite_step
        return None

    # -- evaluation -------------------------------------------------------------------

    def status(self) -> HealthStatus:
        """The latest verdict (``ok`` with no signals before the first evaluation)."""
        with self._lock:
            return self._status

    @property
    def last_evaluation(self) -> Evaluation | None:
        with self._lock:
            return self._evaluation

    def evaluate_now(self) -> HealthStatus:
        """Read every source, evaluate, act, on the calling thread."""
        return self._evaluate(self.sources)

    def _evaluate(self, refresh: Iterable[ReadingSource], *, rollback: bool = True
                  ) -> HealthStatus:
        with self._evaluating:
            positions = {id(s): i for i, s in enumerate(self.sources)}
            for source in refresh:
                i = positions[id(source)]
                try:
                    self._readings[i] = dict(source.read())
                except Exception as exc:
                    self._readings.pop(i, None)  # no stale readings from a broken source
                    error = f"{type(exc).__name__}: {exc}"
                    if self._errors.get(i) != error:
                        log.warning("health source %s failed: %s", source.name, error,
                                    exc_info=True)
                    self._errors[i] = error
                else:
                    if self._errors.pop(i, None) is not None:
                        log.info("health source %s recovered", source.name)
            signals: Reading = {}
            for i in range(len(self.sources)):
                signals.update(self._readings.get(i, {}))
            signals["probe_source_errors"] = len(self._errors)
            evaluation = self.policy.evaluate(signals)
            reasons = evaluation.reasons + tuple(
                f"source {self.sources[i].name} failed: {error}"
                for i, error in sorted(self._errors.items())
            )
            status = HealthStatus(evaluation.state, reasons, signals)
            with self._lock:
                self._status, self._evaluation = status, evaluation
            actions = self._decide(evaluation, rollback)
        # Outside the lock: a slow handler on the probe thread must not hold up a
        # non-finite loss being evaluated on the training thread.
        for action in actions:
            self._dispatch(action)
        return status

    def _decide(self, evaluation: Evaluation, rollback: bool = True) -> list[Action]:
        """The actions to ask for now: only for causes not asked for yet, and
        ``snapshot`` at most once per ``snapshot_min_interval_s``; ``rollback`` only
        when ``rollback`` is True (the caller's thread)."""
        now = self._clock()
        actions: list[Action] = []
        for kind in ACTION_NAMES:
            triggers = evaluation.triggers.get(kind, ())
            current = {t.ident for t in triggers}
            acked = self._acked.setdefault(kind, set())
            acked &= current  # a cause that went away may ask again if it comes back
            new = [t for t in triggers if t.ident not in acked]
            if not new:
                continue
            if kind == "rollback" and not rollback:
                # Left to the record_step that passed the loss: the probe thread may
                # read it first, and the loop would then step on before the request.
                continue
            if kind == "snapshot":
                last = self._last_snapshot_at
                if last is not None and now - last < self.policy.actions.snapshot_min_interval_s:
                    continue  # not acked: asked for once the interval has passed, if it holds
                self._last_snapshot_at = now
            acked |= current
            step = evaluation.nonfinite_step if kind == "rollback" else None
            reason = "; ".join(t.reason for t in new)
            actions.append(Action(kind, reason, evaluation.state, step))
        return actions

    def _dispatch(self, action: Action) -> None:
        log.info("health: %s (%s): %s", action.kind, action.state, action.reason)
        if self._on_action is None:
            return
        try:
            self._on_action(action)
        except Exception:
            log.exception("health action handler failed on %s", action.kind)

    # -- the thread -------------------------------------------------------------------

    def start(self) -> None:
        """Start the daemon thread (no-op when running); it evaluates at once."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ckptd-health-probe",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._evaluate(self.sources, rollback=False)
            except Exception:  # never let one bad evaluation end the probe
                log.exception("health probe evaluation failed")
            self._stop.wait(self.interval_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> bool:
        """Stop the thread; True when it ended within ``timeout`` seconds."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():  # from on_action: it ends after this round
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def close(self, timeout: float | None = 5.0) -> bool:
        """Stop the thread and close every source."""
        stopped = self.stop(timeout)
        for source in self.sources:
            try:
                source.close()
            except Exception:
                log.exception("closing health source %s", source.name)
        return stopped

    def __enter__(self) -> HealthProbe:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def default_sources(
    policy: Policy | None = None,
    *,
    disk_paths: Iterable[str | os.PathLike[str]] = (),
    gpus: Sequence[int | str] | None = None,
    clock: Clock = time.monotonic,
) -> list[ReadingSource]:
    """NVML (``gpus``: this rank's device, by UUID preferably), the host (free space
    at ``disk_paths``: the staging pool, the local cache), the loop and the server
    round trip, set up from ``policy``'s ``[probe]``."""
    probe = (policy if policy is not None else default_policy()).probe
    return [
        NvmlSource(gpus),
        HostSource(disk_paths),
        LoopSource(window=probe.step_window, min_samples=probe.step_min_samples, clock=clock),
        RttSource(),
    ]
