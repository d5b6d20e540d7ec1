"""NvmlSource against a real GPU: skipped unless NVML finds a device."""

from __future__ import annotations

import json

import pytest

from ckptd.client.health.nvml import NvmlSource
from ckptd.client.health.policy import GPU_SIGNALS, default_policy
from ckptd.client.health.probe import HealthProbe

pynvml = pytest.importorskip("pynvml")


def _gpu_count() -> int:
    try:
        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        pynvml.nvmlShutdown()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(60),
    pytest.mark.skipif(_gpu_count() == 0, reason="NVML finds no GPU"),
]


def test_reads_real_signals() -> None:
    source = NvmlSource([0])
    try:
        assert source.available, source.unavailable_reason
        assert source.devices == ["0"]
        r = source.read()
        assert set(r) == {f"{name}[0]" for name in GPU_SIGNALS}
        temperature = r["gpu_temperature_c[0]"]
        assert isinstance(temperature, float) and 0 < temperature < 130
        used = r["gpu_memory_used_percent[0]"]
        assert isinstance(used, float) and 0 <= used <= 100
        assert isinstance(r["gpu_power_w[0]"], float | str)
        assert r["gpu_lost[0]"] == 0
        reasons = r["gpu_throttle_reasons[0]"]
        assert isinstance(reasons, str) and reasons
        assert r["gpu_throttle_hw[0]"] in (0, 1, "unavailable")
        for name in ("gpu_ecc_uncorrected_volatile", "gpu_ecc_uncorrected_aggregate",
                     "gpu_recovery_action", "gpu_remapped_rows_pending", "gpu_xid_events"):
            value = r[f"{name}[0]"]
            assert value == "unavailable" or (isinstance(value, int) and value >= 0), name
        # A second read drains XID events again without blocking.
        assert set(source.read()) == set(r)
    finally:
        source.close()


def test_every_gpu_by_default_and_by_uuid() -> None:
    every = NvmlSource()
    try:
        assert every.available and every.devices
    finally:
        every.close()
    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    by_uuid = NvmlSource([uuid])
    try:
        assert by_uuid.devices == ["0"]
    finally:
        by_uuid.close()


def test_a_probe_on_the_real_gpu_evaluates_cleanly() -> None:
    with HealthProbe(default_policy(), [NvmlSource([0])], interval_s=0.05) as probe:
        status = probe.evaluate_now()
    assert status.signals["probe_source_errors"] == 0
    assert not any(reason.startswith("source ") for reason in status.reasons)
    json.dumps(status.to_json(), allow_nan=False)
