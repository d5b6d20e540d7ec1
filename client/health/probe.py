"""The health probe: a background thread that reads the GPU, the host, the training
loop and the round trip to the server, evaluates the policy and asks for actions.

Each kind of reading sits behind one small interface, ``ReadingSource``:

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

import abc
import importlib
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psutil

from ckptd.errors import InvalidRequest

from .policy import (
    ACTION_NAMES,
    GPU_SIGNALS,
    UNAVAILABLE,
    ActionName,
    Evaluation,
    Level,
    Policy,
    SignalValue,
    default_policy,
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
    step. A step number lower than the last one (a restore) restarts the timing.
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
        self._loss: float | None = None
        self._nonfinite_step: int | None = None

    def record_step(self, step: int, loss: float | None = None) -> bool:
        """Record that the loop finished ``step``; False when ``loss`` is non-finite."""
        now = self._clock()
        value = None if loss is None else float(loss)
        with self._lock:
            if self._step is None or step < self._step:
                self._restart_timing()
                self._step_started = now
            elif step > self._step:
                assert self._step_started is not None
                duration = now - self._step_started
                ratio = None
                if len(self._durations) >= self._min_samples:
                    median = statistics.median(self._durations)
                    ratio = duration / median if median > 0 else None
                self._durations.append(duration)
                self._last_duration, self._last_ratio = duration, ratio
                self._step_started = now
            self._step = step
            self._last_report = now
            if value is not None:
                self._loss = value
                if not math.isfinite(value) and self._nonfinite_step is None:
                    self._nonfinite_step = step
        return value is None or math.isfinite(value)

    def _restart_timing(self) -> None:
        self._durations.clear()
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


# XIDs that name a hardware or driver fault rather than an application bug (NVIDIA's
# XID catalog): double-bit ECC, micro-controller halts, row-remap / page-retirement
# events and failures, NVLink, fallen off the bus, high SBE rate, contained and
# uncontained ECC, GSP errors.
XID_HARDWARE: frozenset[int] = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})

# Clock event (throttle) reason bits, as nvml.h defines them.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
HW_THROTTLE_MASK = 0x8 | 0x40 | 0x80

_XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
_NVML_ERROR_TIMEOUT = 10
_NVML_ERROR_GPU_IS_LOST = 15


def decode_throttle_reasons(mask: int) -> list[str]:
    """The names of the clock event reasons set in ``mask`` (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    if mask & ~known:
        names.append(hex(mask & ~known))
    return names


def _nvml_code(exc: BaseException) -> int | None:
    code = getattr(exc, "value", None)
    return code if isinstance(code, int) else None


class NvmlSource(ReadingSource):
    """GPU signals through NVML, one set per device (``gpu_temperature_c[0]``, ...).

    ``devices``: NVML indices, UUIDs (``"GPU-..."``, a bare UUID gets the prefix)
    or PCI bus ids; None reads every GPU. NVML indices follow PCI order and ignore
    ``CUDA_VISIBLE_DEVICES``: pass the UUID of the rank's device to be sure.
    Where NVML, a GPU or a single query is missing, the signals read
    ``"unavailable"``; nothing here raises after construction, nor during it.
    ``nvml`` replaces the ``pynvml`` module (tests pass a fake one).
    """

    name = "nvml"

    def __init__(self, devices: Sequence[int | str] | None = None, *,
                 nvml: Any = None, max_events_per_read: int = 1000) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[str, Any]] = []
        self._label_by_index: dict[int, str] = {}
        self._events: Any = None
        self._xid_labels: set[str] = set()
        self._xid_count: dict[str, int] = {}
        self._xid_hw: dict[str, int] = {}
        self._xid_last: dict[str, int] = {}
        self._max_events = max_events_per_read
        self._lock = threading.Lock()
        self.unavailable_reason: str | None = None
        try:
            module = nvml if nvml is not None else importlib.import_module("pynvml")
        except ImportError as exc:
            self._unavailable(f"nvidia-ml-py is not installed ({exc})")
            return
        try:
            module.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._unavailable(f"NVML did not initialise: {exc}")
            return
        self._nvml = module
        try:
            self._handles = self._resolve(devices)
        except Exception as exc:
            self._unavailable(f"NVML could not open the GPUs {devices!r}: {exc}")
            self.close()
            return
        if not self._handles:
            self._unavailable("NVML sees no GPU")
            self.close()
            return
        self._register_xid_events()

    def _unavailable(self, reason: str) -> None:
        self.unavailable_reason = reason
        log.info("GPU health signals unavailable: %s", reason)

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    @property
    def devices(self) -> list[str]:
        """The labels (NVML indices) of the devices read."""
        return [label for label, _ in self._handles]

    def _resolve(self, devices: Sequence[int | str] | None) -> list[tuple[str, Any]]:
        nvml = self._nvml
        wanted: Sequence[int | str] = (
            list(range(nvml.nvmlDeviceGetCount())) if devices is None else devices
        )
        handles: list[tuple[str, Any]] = []
        for position, device in enumerate(wanted):
            if isinstance(device, int):
                handle = nvml.nvmlDeviceGetHandleByIndex(device)
            elif ":" in device:
                handle = nvml.nvmlDeviceGetHandleByPciBusId(device)
            else:
                uuid = device if device.startswith(("GPU-", "MIG-")) else f"GPU-{device}"
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            try:
                index = int(nvml.nvmlDeviceGetIndex(handle))
            except Exception:  # a MIG handle has no index of its own
                label = str(device if isinstance(device, int) else position)
            else:
                label = str(index)
                self._label_by_index[index] = label
            handles.append((label, handle))
        return handles

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        xid_type = getattr(nvml, "nvmlEventTypeXidCriticalError", _XID_EVENT)
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception as exc:
            log.info("XID events unavailable: %s", exc)
            return
        for label, handle in self._handles:
            try:
                if nvml.nvmlDeviceGetSupportedEventTypes(handle) & xid_type:
                    nvml.nvmlDeviceRegisterEvents(handle, xid_type, events)
                    self._xid_labels.add(label)
            except Exception as exc:  # not every GPU (or permission) allows it
                log.info("XID events unavailable on GPU %s: %s", label, exc)
        if self._xid_labels:
            self._events = events
        else:
            self._free_events(events)

    def _free_events(self, events: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(events)
        except Exception as exc:
            log.debug("nvmlEventSetFree: %s", exc)

    def _drain_xid_events(self) -> None:
        nvml = self._nvml
        xid_type = getattr(nvml, "nvmlEventTypeXidCriticalError", _XID_EVENT)
        timeout_code = getattr(nvml, "NVML_ERROR_TIMEOUT", _NVML_ERROR_TIMEOUT)
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        for _ in range(self._max_events):
            try:
                data = wait(self._events, 0)  # 0 ms: never blocks the probe thread
            except Exception as exc:
                if _nvml_code(exc) != timeout_code:
                    log.debug("nvmlEventSetWait: %s", exc)
                return
            if not (int(data.eventType) & xid_type):
                continue
            label: str | None
            try:
                label = self._label_by_index[int(nvml.nvmlDeviceGetIndex(data.device))]
            except Exception:
                label = self._handles[0][0] if len(self._handles) == 1 else None
            if label is None:
                continue
            xid = int(data.eventData)
            self._xid_count[label] = self._xid_count.get(label, 0) + 1
            if xid in XID_HARDWARE:
                self._xid_hw[label] = self._xid_hw.get(label, 0) + 1
            self._xid_last[label] = xid
            log.warning("GPU %s reported XID %d", label, xid)

    def read(self) -> Reading:
        with self._lock:
            if not self.available:
                return dict.fromkeys(GPU_SIGNALS, UNAVAILABLE)
            if self._events is not None:
                self._drain_xid_events()
            out: Reading = {}
            for label, handle in self._handles:
                out.update(self._read_device(label, handle))
            return out

    def _read_device(self, label: str, handle: Any) -> Reading:
        nvml = self._nvml
        lost_code = getattr(nvml, "NVML_ERROR_GPU_IS_LOST", _NVML_ERROR_GPU_IS_LOST)
        out: dict[str, SignalValue] = dict.fromkeys(
            (signal_key(name, label) for name in GPU_SIGNALS), UNAVAILABLE
        )
        lost = False

        def query(fn: Callable[[], Any]) -> Any:
            nonlocal lost
            try:
                return fn()
            except Exception as exc:  # NOT_SUPPORTED, NO_PERMISSION, an old driver...
                lost = lost or _nvml_code(exc) == lost_code
                return None

        def put(name: str, value: SignalValue) -> None:
            if value is not None:
                out[signal_key(name, label)] = value

        put("gpu_temperature_c", query(
            lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))))
        put("gpu_power_w", query(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))
        put("gpu_utilization_percent", query(
            lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
        memory = query(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None and memory.total:
            put("gpu_memory_used_percent", round(100.0 * memory.used / memory.total, 2))
        uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)

        def ecc(counter: int) -> int:
            return int(nvml.nvmlDeviceGetTotalEccErrors(handle, uncorrected, counter))

        put("gpu_ecc_uncorrected_volatile",
            query(lambda: ecc(getattr(nvml, "NVML_VOLATILE_ECC", 0))))
        put("gpu_ecc_uncorrected_aggregate",
            query(lambda: ecc(getattr(nvml, "NVML_AGGREGATE_ECC", 1))))
        put("gpu_retired_pages", query(lambda: sum(
            len(nvml.nvmlDeviceGetRetiredPages(handle, cause)) for cause in (0, 1))))
        put("gpu_retired_pages_pending", query(
            lambda: int(bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)))))
        rows = query(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        if rows is not None:
            _corrected, _uncorrected, pending, failed = rows
            put("gpu_remapped_rows_pending", int(bool(pending)))
            put("gpu_remapped_rows_failed", int(bool(failed)))
        # The "event reasons" name replaced "throttle reasons" in newer nvidia-ml-py.
        reasons_fn = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                      or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        mask = None if reasons_fn is None else query(lambda: int(reasons_fn(handle)))
        if mask is not None:
            put("gpu_throttle_reasons", ",".join(decode_throttle_reasons(mask)) or "none")
            put("gpu_throttle_hw", int(bool(mask & HW_THROTTLE_MASK)))
        put("gpu_recovery_action", query(lambda: self._recovery_action(handle)))
        if label in self._xid_labels:
            put("gpu_xid_events", self._xid_count.get(label, 0))
            put("gpu_xid_hw_events", self._xid_hw.get(label, 0))
            out[signal_key("gpu_xid_last", label)] = self._xid_last.get(label)
        out[signal_key("gpu_lost", label)] = int(lost)
        return out

    def _recovery_action(self, handle: Any) -> int | None:
        nvml = self._nvml
        field_id = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:  # an nvidia-ml-py older than the field
            return None
        value = nvml.nvmlDeviceGetFieldValues(handle, [field_id])[0]
        if int(value.nvmlReturn) != 0:
            return None
        member = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
        kind = int(value.valueType)
        return int(getattr(value.value, member[kind] if kind < len(member) else "uiVal"))

    def close(self) -> None:
        with self._lock:
            if self._nvml is None:
                return
            if self._events is not None:
                self._free_events(self._events)
                self._events = None
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._nvml = None


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
    ``evaluate_now`` and for a non-finite loss passed to ``record_step`` (so the
    rollback is asked for before ``record_step`` returns). It should hand slow
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
        if not self.interval_s > 0:
            raise InvalidRequest(f"HealthProbe: interval_s must be > 0, not {interval_s}")
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

    def _evaluate(self, refresh: Iterable[ReadingSource]) -> HealthStatus:
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
            actions = self._decide(evaluation)
        # Outside the lock: a slow handler on the probe thread must not hold up a
        # non-finite loss being evaluated on the training thread.
        for action in actions:
            self._dispatch(action)
        return status

    def _decide(self, evaluation: Evaluation) -> list[Action]:
        """The actions to ask for now: only for causes not asked for yet, and
        ``snapshot`` at most once per ``snapshot_min_interval_s``."""
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
                self.evaluate_now()
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
