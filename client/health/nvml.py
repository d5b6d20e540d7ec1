"""The GPU's readings through nvidia-ml-py (``NvmlSource``): every GPU signal
reads ``"unavailable"`` where NVML or a GPU is absent, and it never raises."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .policy import (
    GPU_SIGNALS,
    UNAVAILABLE,
    SignalValue,
    signal_key,
)
from .readings import Reading, ReadingSource

log = logging.getLogger(__name__)


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
        self._open_errors: list[str] = []
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
            self._unavailable(f"NVML could not open the GPUs {devices!r}: "
                              f"{'; '.join(self._open_errors)}" if self._open_errors
                              else "NVML sees no GPU")
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
        lost_code = getattr(nvml, "NVML_ERROR_GPU_IS_LOST", _NVML_ERROR_GPU_IS_LOST)
        handles: list[tuple[str, Any]] = []
        for position, device in enumerate(wanted):
            # Each device on its own: one that fell off the bus reads gpu_lost = 1
            # (a None handle) and must not take the others' signals with it.
            try:
                handle = self._open(device)
            except Exception as exc:
                if _nvml_code(exc) != lost_code:
                    log.info("NVML could not open GPU %r: %s", device, exc)
                    self._open_errors.append(f"{device!r}: {exc}")
                    continue
                label = str(device if isinstance(device, int) else position)
                log.error("GPU %s is lost: %s", label, exc)
                handles.append((label, None))
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(handle))
            except Exception:  # a MIG handle has no index of its own
                label = str(device if isinstance(device, int) else position)
            else:
                label = str(index)
                self._label_by_index[index] = label
            handles.append((label, handle))
        return handles

    def _open(self, device: int | str) -> Any:
        nvml = self._nvml
        if isinstance(device, int):
            return nvml.nvmlDeviceGetHandleByIndex(device)
        if ":" in device:
            return nvml.nvmlDeviceGetHandleByPciBusId(device)
        uuid = device if device.startswith(("GPU-", "MIG-")) else f"GPU-{device}"
        return nvml.nvmlDeviceGetHandleByUUID(uuid)

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        xid_type = getattr(nvml, "nvmlEventTypeXidCriticalError", _XID_EVENT)
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception as exc:
            log.info("XID events unavailable: %s", exc)
            return
        for label, handle in self._handles:
            if handle is None:  # lost
                continue
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
                if handle is None:  # lost when the probe started: nothing to query
                    out.update(dict.fromkeys(
                        (signal_key(name, label) for name in GPU_SIGNALS), UNAVAILABLE))
                    out[signal_key("gpu_lost", label)] = 1
                else:
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
