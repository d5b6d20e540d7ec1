"""Readings of a rank's health, each source behind one small interface
(``ReadingSource``): scripted readings (tests and drills), the training loop's
steps and loss, the round trip to the server, and the host (psutil). The GPU's
source is ``nvml.py``; the probe that reads them all is ``probe.py``."""

from __future__ import annotations

import abc
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import psutil

from ckptd.errors import InvalidRequest

from .policy import (
    UNAVAILABLE,
    SignalValue,
    signal_key,
)

log = logging.getLogger(__name__)

Reading = dict[str, SignalValue]
Clock = Callable[[], float]
S = TypeVar("S", bound="ReadingSource")


# -- sources --------------------------------------------------------------------------


class ReadingSource(abc.ABC):
    """One place readings come from; ``read`` returns ``{signal key: value}``."""

    name: str = "source"

    @abc.abstractmethod
    def read(self) -> Reading:
        """The current readings. May raise: the probe reports it and carries on."""

    def close(self) -> None:  # noqa: B027 - most sources hold nothing
        """Release what the source holds (idempotent)."""


class ScriptedSource(ReadingSource):
    """Replays readings in order, then repeats the last one.

    An exception in the script is raised by the ``read`` that reaches it, so a
    test can script a source that fails.
    """

    def __init__(
        self,
        readings: Iterable[Mapping[str, SignalValue] | BaseException] = (),
        name: str = "scripted",
        *,
        repeat_last: bool = True,
    ) -> None:
        self.name = name
        self._readings: list[Mapping[str, SignalValue] | BaseException] = list(readings)
        self._next = 0
        self._repeat_last = repeat_last
        self._lock = threading.Lock()
        self.reads = 0

    def push(self, *readings: Mapping[str, SignalValue] | BaseException) -> None:
        """Append readings to the script."""
        with self._lock:
            self._readings.extend(readings)

    def read(self) -> Reading:
        with self._lock:
            self.reads += 1
            if self._next < len(self._readings):
                item = self._readings[self._next]
                self._next += 1
            elif self._readings and self._repeat_last:
                item = self._readings[-1]
            else:
                return {}
        if isinstance(item, BaseException):
            raise item
        return dict(item)


class LoopSource(ReadingSource):
    """What the training loop reports through ``record_step``.

    A step's time is from the first report of one step number to the first report
    of the next, so a loop that reports each micro-batch of a step is timed per
    step, less the time the loop spent waiting in ckptd meanwhile (``exclude``:
    a ``save()`` copying its snapshot, or held back by the one before it while the
    store is slow): that is ckptd's, not the node's, and a snapshot asked for
    because the last one was slow would only add to it. A step number lower than
    the last one (a restore) restarts the timing.
    The non-finite flag stays set until ``reset``: after a NaN, only a rollback
    makes the state safe again.
    """

    name = "loop"

    def __init__(self, *, window: int = 50, min_samples: int = 5,
                 clock: Clock = time.monotonic) -> None:
        if window < 2 or not 1 <= min_samples <= window:
            raise InvalidRequest(f"LoopSource: need 2 <= window and 1 <= min_samples <= "
                                 f"window, got window={window} min_samples={min_samples}")
        self._clock = clock
        self._min_samples = min_samples
        self._durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._step: int | None = None
        self._step_started: float | None = None  # first report of the current step
        self._last_report: float | None = None
        self._last_duration: float | None = None
        self._last_ratio: float | None = None
        self._waited = 0.0  # in ckptd since the current step's first report
        self._loss: float | None = None
        self._nonfinite_step: int | None = None

    def record_step(self, step: int, loss: float | None = None) -> bool:
        """Record that the loop finished ``step``; False when ``loss`` is non-finite."""
        now = self._clock()
        try:
            value = None if loss is None else float(loss)
        except (TypeError, ValueError, RuntimeError):  # ("x", a tensor of many elements)
            raise InvalidRequest(f"loss {loss!r:.80} must be a number (a float, or a tensor "
                                 "of one element)") from None
        with self._lock:
            if self._step is None or step < self._step:
                self._restart_timing()
                self._step_started = now
            elif step > self._step:
                assert self._step_started is not None
                duration = max(0.0, now - self._step_started - self._waited)
                ratio = None
                if len(self._durations) >= self._min_samples:
                    median = statistics.median(self._durations)
                    ratio = duration / median if median > 0 else None
                self._durations.append(duration)
                self._last_duration, self._last_ratio = duration, ratio
                self._step_started = now
                self._waited = 0.0
            self._step = step
            self._last_report = now
            if value is not None:
                self._loss = value
                if not math.isfinite(value) and self._nonfinite_step is None:
                    self._nonfinite_step = step
        return value is None or math.isfinite(value)

    def exclude(self, seconds: float) -> None:
        """``seconds`` the loop spent waiting in ckptd: not part of the step's time."""
        with self._lock:
            if self._step_started is not None:
                self._waited += max(0.0, seconds)

    def recent_step_time(self, n: int = 3) -> float | None:
        """The median of the last ``n`` step times (one slow step does not move it;
        a slowdown does, long before the window's median), or None before ``n``."""
        with self._lock:
            if len(self._durations) < n:
                return None
            return statistics.median(list(self._durations)[-n:])

    def _restart_timing(self) -> None:
        self._durations.clear()
        self._waited = 0.0
        self._last_duration = self._last_ratio = None

    def reset(self) -> None:
        """Forget timings and the non-finite loss: call after a restore or rollback."""
        with self._lock:
            self._restart_timing()
            self._step = self._step_started = self._last_report = None
            self._loss = self._nonfinite_step = None

    @property
    def nonfinite_step(self) -> int | None:
        """The step whose loss was non-finite, until ``reset``."""
        with self._lock:
            return self._nonfinite_step

    def read(self) -> Reading:
        now = self._clock()
        with self._lock:
            loss: SignalValue = self._loss
            if self._loss is not None and not math.isfinite(self._loss):
                loss = str(self._loss)  # "nan", "inf", "-inf": JSON has no such numbers
            return {
                "last_step": self._step,
                "step_time_s": self._last_duration,
                "step_time_median_s": (
                    statistics.median(self._durations) if self._durations else None
                ),
                "step_time_ratio": self._last_ratio,
                "seconds_since_step": (
                    None if self._last_report is None else max(0.0, now - self._last_report)
                ),
                "loss": loss,
                "loss_nonfinite": 0 if self._nonfinite_step is None else 1,
                "loss_nonfinite_step": self._nonfinite_step,
            }


class RttSource(ReadingSource):
    """The round trip of heartbeats to the server, fed by ``record_rtt``."""

    name = "server"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rtt_ms: float | None = None
        self._failures = 0

    def record_rtt(self, ms: float | None) -> None:
        """One heartbeat's round trip in milliseconds; None when it failed."""
        with self._lock:
            if ms is None:
                self._failures += 1
            else:
                self._rtt_ms = float(ms)
                self._failures = 0

    def read(self) -> Reading:
        with self._lock:
            return {"server_rtt_ms": self._rtt_ms, "server_heartbeat_failures": self._failures}


def _existing_ancestor(path: Path) -> Path:
    # A cache directory may not exist yet; the file system it will live on does.
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class HostSource(ReadingSource):
    """Host memory, swap and CPU, and free space where each of ``paths`` lives."""

    name = "host"

    def __init__(self, paths: Iterable[str | os.PathLike[str]] = ()) -> None:
        self._paths = list(dict.fromkeys(str(p) for p in paths))
        # cpu_percent(None) compares with the previous call: prime it so the first
        # reading means something.
        psutil.cpu_percent(interval=None)

    def read(self) -> Reading:
        out: Reading = {
            "host_memory_percent": round(float(psutil.virtual_memory().percent), 2),
            "host_swap_percent": round(float(psutil.swap_memory().percent), 2),
            "host_cpu_percent": round(float(psutil.cpu_percent(interval=None)), 2),
        }
        for path in self._paths:
            percent: SignalValue = UNAVAILABLE
            gib: SignalValue = UNAVAILABLE
            try:
                usage = psutil.disk_usage(str(_existing_ancestor(Path(path))))
            except OSError as exc:
                log.debug("disk usage of %s: %s", path, exc)
            else:
                if usage.total > 0:
                    percent = round(100.0 * usage.free / usage.total, 2)
                    gib = round(usage.free / (1 << 30), 3)
            out[signal_key("disk_free_percent", path)] = percent
            out[signal_key("disk_free_gib", path)] = gib
        return out
