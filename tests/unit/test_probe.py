"""The health probe: scripted readings through the policy to actions, the loop's
stall and NaN detection, sources that fail, NVML without a GPU (and a fake NVML
with one), the host, and the thread's lifecycle."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptd.client.health.nvml import NvmlSource, decode_throttle_reasons
from ckptd.client.health.policy import GPU_SIGNALS, Policy, default_policy
from ckptd.client.health.policy_file import parse_policy
from ckptd.client.health.probe import Action, HealthProbe, HealthStatus, default_sources
from ckptd.client.health.readings import (
    HostSource,
    LoopSource,
    ReadingSource,
    RttSource,
    ScriptedSource,
)
from ckptd.errors import CkptdError, InvalidRequest, RollbackRequested

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """An on_action that keeps what it was given."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.lock = threading.Lock()

    def __call__(self, action: Action) -> None:
        with self.lock:
            self.actions.append(action)

    def kinds(self) -> list[str]:
        with self.lock:
            return [a.kind for a in self.actions]

    def clear(self) -> None:
        with self.lock:
            self.actions.clear()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def make_probe(
    sources: list[ReadingSource], clock: FakeClock, recorder: Recorder,
    policy: Policy | None = None,
) -> HealthProbe:
    return HealthProbe(policy or default_policy(), sources, interval_s=1.0,
                       on_action=recorder, clock=clock)


OK = {"gpu_temperature_c[0]": 60, "gpu_ecc_uncorrected_volatile[0]": 0}
ECC_1 = {"gpu_temperature_c[0]": 60, "gpu_ecc_uncorrected_volatile[0]": 1}
ECC_12 = {"gpu_temperature_c[0]": 60, "gpu_ecc_uncorrected_volatile[0]": 12}


# -- scripted readings through the policy --------------------------------------------


def test_ecc_crossing_degrades_and_asks_for_one_snapshot(clock: FakeClock,
                                                         recorder: Recorder) -> None:
    source = ScriptedSource([OK, ECC_1, ECC_1, ECC_1], name="gpu")
    probe = make_probe([source], clock, recorder)

    assert probe.evaluate_now().state == "ok"
    assert recorder.actions == []

    clock.advance(5)
    status = probe.evaluate_now()
    assert status.state == "degraded"
    assert status.reasons == ("gpu0 uncorrected ECC errors since driver load 1 >= degraded 1",)
    assert recorder.actions == [Action(
        "snapshot", "gpu0 uncorrected ECC errors since driver load 1 >= degraded 1", "degraded"
    )]

    # Still degraded for the same cause: asked for once, even past the rate limit.
    for _ in range(2):
        clock.advance(400)
        assert probe.evaluate_now().state == "degraded"
    assert recorder.kinds() == ["snapshot"]
    assert probe.status().signals["gpu_ecc_uncorrected_volatile[0]"] == 1


def test_snapshots_are_rate_limited_and_a_deferred_cause_is_asked_later(
    clock: FakeClock, recorder: Recorder
) -> None:
    hot = {"gpu_temperature_c[0]": 90, "gpu_ecc_uncorrected_volatile[0]": 0}
    hot_and_ecc = {"gpu_temperature_c[0]": 90, "gpu_ecc_uncorrected_volatile[0]": 1}
    source = ScriptedSource([hot, hot_and_ecc, hot_and_ecc])
    probe = make_probe([source], clock, recorder)  # snapshot_min_interval_s = 300

    probe.evaluate_now()
    assert recorder.kinds() == ["snapshot"]
    clock.advance(60)
    probe.evaluate_now()  # a new cause, but within 300 s of the last snapshot
    assert recorder.kinds() == ["snapshot"]
    clock.advance(250)
    probe.evaluate_now()  # the window has passed and the cause holds
    assert recorder.kinds() == ["snapshot", "snapshot"]
    assert "ECC" in recorder.actions[1].reason and "temperature" not in recorder.actions[1].reason


def test_critical_asks_for_snapshot_and_reports_failing(clock: FakeClock,
                                                        recorder: Recorder) -> None:
    probe = make_probe([ScriptedSource([ECC_12])], clock, recorder)
    status = probe.evaluate_now()
    assert status.state == "critical"
    assert recorder.kinds() == ["snapshot", "report_failing"]
    assert all(a.state == "critical" for a in recorder.actions)
    assert recorder.actions[1].reason == (
        "gpu0 uncorrected ECC errors since driver load 12 >= critical 10"
    )


def test_escalation_from_degraded_to_critical_reports_failing(clock: FakeClock,
                                                              recorder: Recorder) -> None:
    probe = make_probe([ScriptedSource([ECC_1, ECC_12])], clock, recorder)
    probe.evaluate_now()
    clock.advance(400)
    probe.evaluate_now()
    assert recorder.kinds() == ["snapshot", "snapshot", "report_failing"]


def test_ecc_on_rank_2_of_4_only_that_rank_asks_for_a_snapshot(clock: FakeClock) -> None:
    recorders = [Recorder() for _ in range(4)]
    probes = [
        make_probe([ScriptedSource([OK, ECC_1 if rank == 2 else OK])], clock, recorders[rank])
        for rank in range(4)
    ]
    for _ in range(2):
        for probe in probes:
            probe.evaluate_now()
        clock.advance(5)
    assert [r.kinds() for r in recorders] == [[], [], ["snapshot"], []]
    assert [p.status().state for p in probes] == ["ok", "ok", "degraded", "ok"]


# -- the loop: NaN and stalls ------------------------------------------------------------


def loop_probe(clock: FakeClock, recorder: Recorder, policy: Policy | None = None,
               *extra: ReadingSource) -> tuple[HealthProbe, LoopSource]:
    policy = policy or default_policy()
    loop = LoopSource(window=policy.probe.step_window,
                      min_samples=policy.probe.step_min_samples, clock=clock)
    return make_probe([loop, RttSource(), *extra], clock, recorder, policy), loop


def test_nan_loss_asks_for_rollback_at_once_and_never_a_snapshot(clock: FakeClock,
                                                                 recorder: Recorder) -> None:
    # The GPU is degraded too: that alone would ask for a snapshot.
    probe, _ = loop_probe(clock, recorder, None, ScriptedSource([ECC_1]))
    probe.record_step(1, loss=2.5)
    clock.advance(1)
    probe.record_step(2, loss=math.nan)
    # Evaluated before record_step returned, without waiting for the thread.
    assert recorder.kinds() == ["rollback"]
    assert recorder.actions[0].step == 2
    assert recorder.actions[0].reason == "loss became non-finite at step 2"
    assert probe.nonfinite_step == 2

    for _ in range(3):  # the loop goes on producing NaN; the probe goes on reading
        clock.advance(400)
        step = probe.status().signals["last_step"]
        assert isinstance(step, int)
        probe.record_step(step + 1, loss=math.nan)
        probe.evaluate_now()
    assert recorder.kinds() == ["rollback"]
    status = probe.status()
    assert status.state == "degraded"
    assert "loss became non-finite at step 2 (degraded)" in status.reasons
    assert status.signals["loss"] == "nan"
    json.dumps(status.to_json(), allow_nan=False)  # the heartbeat body stays valid JSON

    # After the restore the loop is reset: finite again, and the GPU's cause may
    # finally ask for its snapshot.
    probe.reset_loop()
    assert probe.nonfinite_step is None
    probe.record_step(1, loss=2.4)
    probe.evaluate_now()
    assert recorder.kinds() == ["rollback", "snapshot"]


def test_inf_loss_is_non_finite_too(clock: FakeClock, recorder: Recorder) -> None:
    probe, _ = loop_probe(clock, recorder)
    probe.record_step(10, loss=-math.inf)
    assert recorder.kinds() == ["rollback"]
    assert probe.status().signals["loss"] == "-inf"


def test_a_stalled_loop_is_degraded_within_the_configured_time(clock: FakeClock,
                                                               recorder: Recorder) -> None:
    policy = parse_policy("[signals.seconds_since_step]\ndegraded = 120\ncritical = 600\n")
    probe, _ = loop_probe(clock, recorder, policy)
    assert probe.evaluate_now().state == "ok"  # no step yet: not a stall
    for step in range(1, 8):
        probe.record_step(step, loss=1.0)
        clock.advance(1.0)
    assert probe.evaluate_now().state == "ok"
    clock.advance(118.0)  # 119 s since the last step
    assert probe.evaluate_now().state == "ok"
    clock.advance(1.0)  # 120 s: the loop stopped calling; the probe sees it
    status = probe.evaluate_now()
    assert status.state == "degraded"
    assert status.reasons == ("no step for 120 s >= degraded 120",)
    clock.advance(480)
    assert probe.evaluate_now().state == "critical"
    probe.record_step(8, loss=1.0)  # it moves again, after a 600 s step: 600 x the median
    status = probe.evaluate_now()
    assert status.reasons == ("step time 600x median >= degraded 3",)


def test_a_stalled_loop_is_seen_by_the_probe_thread() -> None:
    policy = parse_policy("[signals.seconds_since_step]\ndegraded = 0.3\ncritical = \"off\"\n")
    loop = LoopSource()
    probe = HealthProbe(policy, [loop], interval_s=0.02)
    with probe:
        loop.record_step(1)
        started = time.monotonic()
        while probe.status().state != "degraded":
            assert time.monotonic() - started < 5.0, probe.status()
            time.sleep(0.01)
        assert time.monotonic() - started >= 0.3
    assert not probe.running


def test_a_slow_step_above_k_times_the_median_is_degraded(clock: FakeClock,
                                                          recorder: Recorder) -> None:
    policy = parse_policy("[probe]\nstep_window = 10\nstep_min_samples = 3\n"
                          "[signals.step_time_ratio]\ndegraded = 3.0\n")
    probe, loop = loop_probe(clock, recorder, policy)
    probe.record_step(0)
    for step in range(1, 6):
        clock.advance(2.0)
        probe.record_step(step)
    status = probe.evaluate_now()
    assert status.state == "ok"
    assert status.signals["step_time_median_s"] == 2.0
    assert status.signals["step_time_ratio"] == 1.0
    clock.advance(6.5)  # 3.25 x the median
    probe.record_step(6)
    status = probe.evaluate_now()
    assert status.state == "degraded"
    assert status.reasons == ("step time 3.25x median >= degraded 3",)
    assert recorder.kinds() == ["snapshot"]


def test_an_interval_the_thread_cannot_wait_is_refused_at_construction() -> None:
    # 1e308 s overflowed the thread's wait: the probe thread died and health stopped.
    with pytest.raises(InvalidRequest, match="interval_s must be > 0 and <= 3600"):
        HealthProbe(default_policy(), [], interval_s=1e308)


def test_loop_timing_per_step_number_and_restart_after_a_restore(clock: FakeClock) -> None:
    loop = LoopSource(window=5, min_samples=1, clock=clock)
    loop.record_step(1)
    clock.advance(0.5)
    loop.record_step(1)  # a second micro-batch of step 1: not a step of its own
    clock.advance(0.5)
    loop.record_step(2)
    reading = loop.read()
    assert reading["step_time_s"] == 1.0 and reading["step_time_ratio"] is None
    clock.advance(3.0)
    loop.record_step(3)
    assert loop.read()["step_time_ratio"] == 3.0
    clock.advance(100.0)
    loop.record_step(1)  # restored to an earlier step: the gap is not a step time
    reading = loop.read()
    assert reading["step_time_s"] is None and reading["step_time_median_s"] is None
    assert reading["seconds_since_step"] == 0.0
    with pytest.raises(InvalidRequest):
        LoopSource(window=1)


def test_rtt_from_heartbeats(clock: FakeClock, recorder: Recorder) -> None:
    probe, _ = loop_probe(clock, recorder)
    probe.record_rtt(12.5)
    assert probe.evaluate_now().signals["server_rtt_ms"] == 12.5
    probe.record_rtt(2500.0)
    probe.record_rtt(None)
    probe.record_rtt(None)
    status = probe.evaluate_now()
    assert status.state == "degraded"
    assert status.reasons == ("server round trip 2500 ms >= degraded 2000",)
    assert status.signals["server_heartbeat_failures"] == 2


def test_record_step_needs_a_loop_source() -> None:
    probe = HealthProbe(default_policy(), [ScriptedSource([OK])])
    with pytest.raises(InvalidRequest, match="no LoopSource"):
        probe.record_step(1, 1.0)
    assert probe.nonfinite_step is None


# -- failing sources ------------------------------------------------------------------


def test_a_source_that_raises_is_reported_and_the_probe_goes_on(clock: FakeClock,
                                                                recorder: Recorder) -> None:
    flaky = ScriptedSource([ECC_1, OSError("NVML went away"), OK], name="flaky")
    host = ScriptedSource([{"host_memory_percent": 50.0}], name="host")
    probe = make_probe([flaky, host], clock, recorder)

    assert probe.evaluate_now().state == "degraded"
    status = probe.evaluate_now()
    # The failing source's old readings are gone; the failure is a reason.
    assert "gpu_ecc_uncorrected_volatile[0]" not in status.signals
    assert status.signals["host_memory_percent"] == 50.0
    assert status.signals["probe_source_errors"] == 1
    assert status.reasons == ("source flaky failed: OSError: NVML went away",)
    status = probe.evaluate_now()
    assert status.state == "ok" and status.reasons == ()
    assert status.signals["probe_source_errors"] == 0


def test_a_raising_source_or_handler_does_not_stop_the_thread() -> None:
    flaky = ScriptedSource([RuntimeError("boom")], name="flaky")  # raises every read
    steady = ScriptedSource([ECC_12], name="steady")

    def handler(action: Action) -> None:
        raise ValueError("the handler is broken too")

    probe = HealthProbe(default_policy(), [flaky, steady], interval_s=0.01, on_action=handler)
    with probe:
        deadline = time.monotonic() + 5
        while steady.reads < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert probe.running
    status = probe.status()
    assert status.state == "critical"
    assert "source flaky failed: RuntimeError: boom" in status.reasons


# -- the thread ------------------------------------------------------------------------


def test_the_thread_runs_and_stops_in_bounded_time(recorder: Recorder) -> None:
    source = ScriptedSource([OK, ECC_1])
    probe = HealthProbe(default_policy(), [source], interval_s=0.01, on_action=recorder)
    probe.start()
    probe.start()  # idempotent
    deadline = time.monotonic() + 5
    while source.reads < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    assert probe.stop(timeout=2.0)
    assert time.monotonic() - started < 2.0
    assert not probe.running
    reads = source.reads
    time.sleep(0.05)
    assert source.reads == reads
    assert recorder.kinds() == ["snapshot"]
    assert probe.status().state == "degraded"


def test_on_action_may_stop_the_probe() -> None:
    stopped: list[bool] = []

    def handler(action: Action) -> None:
        stopped.append(probe.close(timeout=1.0))

    probe = HealthProbe(default_policy(), [ScriptedSource([ECC_12])], interval_s=0.01,
                        on_action=handler)
    probe.start()
    deadline = time.monotonic() + 5
    while probe.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert stopped[:1] == [True]


def test_a_slow_handler_does_not_hold_up_a_nan_on_the_training_thread(
    clock: FakeClock,
) -> None:
    release = threading.Event()
    entered = threading.Event()
    seen: list[str] = []

    def handler(action: Action) -> None:
        seen.append(action.kind)
        if action.kind == "snapshot":
            entered.set()
            release.wait(5)

    loop = LoopSource(clock=clock)
    probe = HealthProbe(default_policy(), [loop, ScriptedSource([ECC_1])], interval_s=3600,
                        on_action=handler, clock=clock)
    worker = threading.Thread(target=probe.evaluate_now)
    worker.start()
    try:
        assert entered.wait(5)
        started = time.monotonic()
        probe.record_step(1, loss=math.nan)  # while the snapshot handler is stuck
        assert time.monotonic() - started < 1.0
        assert "rollback" in seen
    finally:
        release.set()
        worker.join(5)


def test_a_long_interval_does_not_delay_stop() -> None:
    probe = HealthProbe(default_policy(), [ScriptedSource([OK])], interval_s=3600)
    probe.start()
    started = time.monotonic()
    assert probe.close(timeout=2.0)
    assert time.monotonic() - started < 2.0


def test_context_manager_closes_the_sources() -> None:
    closed: list[str] = []

    class Closing(ScriptedSource):
        def close(self) -> None:
            closed.append(self.name)

    with HealthProbe(default_policy(), [Closing([OK], name="a")], interval_s=0.01) as probe:
        assert probe.running
    assert not probe.running and closed == ["a"]


def test_status_before_the_first_evaluation_and_as_json() -> None:
    probe = HealthProbe(default_policy(), [])
    assert probe.status() == HealthStatus("ok", (), {})
    status = HealthStatus("degraded", ("x",), {"a[0]": math.nan, "b": 1, "c": "unavailable"})
    body = status.to_json()
    assert body == {"state": "degraded", "reasons": ["x"],
                    "signals": {"a[0]": "nan", "b": 1, "c": "unavailable"}}
    json.dumps(body, allow_nan=False)
    with pytest.raises(InvalidRequest):
        HealthProbe(default_policy(), [], interval_s=0)


def test_scripted_source_replays_in_order_then_repeats_the_last() -> None:
    source = ScriptedSource([{"a": 1}, {"a": 2}])
    assert [source.read()["a"] for _ in range(4)] == [1, 2, 2, 2]
    source.push({"a": 3})
    assert source.read() == {"a": 3}
    once = ScriptedSource([{"a": 1}], repeat_last=False)
    assert once.read() == {"a": 1} and once.read() == {}


def test_rollback_requested_is_a_typed_error() -> None:
    err = RollbackRequested("loss is NaN at step 7", step=7, rollback_to=5)
    assert isinstance(err, CkptdError) and err.code == "rollback_requested"
    assert (err.step, err.rollback_to) == (7, 5)
    assert err.to_json() == {"code": "rollback_requested", "message": "loss is NaN at step 7",
                             "detail": {"step": 7, "rollback_to": 5}}
    assert RollbackRequested("bare").step is None


# -- NVML and the host ---------------------------------------------------------------


def test_nvml_on_this_machine_is_unavailable_or_real_and_never_raises() -> None:
    source = NvmlSource()
    try:
        reading = source.read()
        if not source.available:
            assert source.unavailable_reason
            assert reading == dict.fromkeys(GPU_SIGNALS, "unavailable")
            # The policy skips them: no GPU is not a degraded rank.
            assert default_policy().evaluate(reading).state == "ok"
    finally:
        source.close()
        source.close()  # idempotent


def test_nvml_init_failure_is_unavailable() -> None:
    class Broken:
        def nvmlInit(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    source = NvmlSource(nvml=Broken())
    assert not source.available
    assert "cannot open shared object" in (source.unavailable_reason or "")
    assert set(source.read().values()) == {"unavailable"}


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """Just enough of pynvml, with devices whose state the test sets."""

    NVML_TEMPERATURE_GPU = 0
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.temperature = dict.fromkeys(range(count), 65)
        self.ecc_volatile = dict.fromkeys(range(count), 0)
        self.throttle = dict.fromkeys(range(count), 0)
        self.recovery = dict.fromkeys(range(count), 0)
        self.remap_pending = dict.fromkeys(range(count), 0)
        self.lost: set[int] = set()
        self.events: deque[tuple[int, int]] = deque()
        self.waits: list[int] = []
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, int]:
        return ("handle", i)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> tuple[str, int]:
        assert uuid.startswith("GPU-")
        return ("handle", int(uuid.rsplit("-", 1)[1]))

    def nvmlDeviceGetIndex(self, h: tuple[str, int]) -> int:
        return h[1]

    def _ok(self, h: tuple[str, int]) -> int:
        if h[1] in self.lost:
            raise FakeNvmlError(self.NVML_ERROR_GPU_IS_LOST)
        return h[1]

    def nvmlDeviceGetTemperature(self, h: tuple[str, int], sensor: int) -> int:
        return self.temperature[self._ok(h)]

    def nvmlDeviceGetPowerUsage(self, h: tuple[str, int]) -> int:
        self._ok(h)
        return 350_500  # milliwatts

    def nvmlDeviceGetUtilizationRates(self, h: tuple[str, int]) -> Any:
        self._ok(h)
        raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)  # as on a MIG slice

    def nvmlDeviceGetMemoryInfo(self, h: tuple[str, int]) -> Any:
        self._ok(h)
        return SimpleNamespace(total=80 << 30, used=20 << 30, free=60 << 30)

    def nvmlDeviceGetTotalEccErrors(self, h: tuple[str, int], kind: int, counter: int) -> int:
        i = self._ok(h)
        assert kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return self.ecc_volatile[i] if counter == self.NVML_VOLATILE_ECC else 7

    def nvmlDeviceGetRetiredPages(self, h: tuple[str, int], cause: int) -> list[int]:
        self._ok(h)
        raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)  # Hopper remaps rows instead

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: tuple[str, int]) -> int:
        self._ok(h)
        raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetRemappedRows(self, h: tuple[str, int]) -> tuple[int, int, int, int]:
        return (0, 0, self.remap_pending[self._ok(h)], 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: tuple[str, int]) -> int:
        return self.throttle[self._ok(h)]

    def nvmlDeviceGetFieldValues(self, h: tuple[str, int], ids: list[int]) -> list[Any]:
        assert ids == [self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        value = SimpleNamespace(uiVal=self.recovery[self._ok(h)])
        return [SimpleNamespace(nvmlReturn=0, valueType=1, value=value)]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: tuple[str, int]) -> int:
        if h[1] == 1:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)
        return 0x8 | 0x1

    def nvmlDeviceRegisterEvents(self, h: tuple[str, int], types: int, event_set: str) -> None:
        assert types == 0x8 and event_set == "event-set"

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self.waits.append(timeout_ms)
        if not self.events:
            raise FakeNvmlError(self.NVML_ERROR_TIMEOUT)
        index, xid = self.events.popleft()
        return SimpleNamespace(device=("handle", index), eventType=0x8, eventData=xid)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass


@pytest.fixture
def fake_nvml() -> Iterator[FakeNvml]:
    yield FakeNvml(count=2)


def test_nvml_source_reads_every_signal_per_device(fake_nvml: FakeNvml) -> None:
    source = NvmlSource(nvml=fake_nvml)
    assert source.available and source.devices == ["0", "1"]
    r = source.read()
    assert r["gpu_temperature_c[0]"] == 65.0
    assert r["gpu_power_w[0]"] == 350.5
    assert r["gpu_utilization_percent[0]"] == "unavailable"
    assert r["gpu_memory_used_percent[1]"] == 25.0
    assert r["gpu_ecc_uncorrected_volatile[0]"] == 0
    assert r["gpu_ecc_uncorrected_aggregate[0]"] == 7
    assert r["gpu_retired_pages[0]"] == "unavailable"
    assert r["gpu_retired_pages_pending[0]"] == "unavailable"
    assert r["gpu_remapped_rows_pending[0]"] == 0
    assert r["gpu_remapped_rows_failed[0]"] == 0
    assert r["gpu_throttle_reasons[0]"] == "none" and r["gpu_throttle_hw[0]"] == 0
    assert r["gpu_recovery_action[0]"] == 0
    assert r["gpu_xid_events[0]"] == 0 and r["gpu_xid_last[0]"] is None
    assert r["gpu_xid_events[1]"] == "unavailable"  # GPU 1 cannot register events
    assert r["gpu_lost[0]"] == 0
    assert set(fake_nvml.waits) == {0}  # never blocks
    assert default_policy().evaluate(r).state == "ok"
    source.close()
    source.close()
    assert (fake_nvml.inits, fake_nvml.shutdowns) == (1, 1)


def test_nvml_faults_reach_the_policy(fake_nvml: FakeNvml) -> None:
    source = NvmlSource(nvml=fake_nvml)
    fake_nvml.ecc_volatile[0] = 1
    fake_nvml.throttle[0] = 0x4 | 0x40  # sw power cap + hw thermal slowdown
    fake_nvml.remap_pending[0] = 1
    fake_nvml.events.extend([(0, 13), (0, 79)])  # an application fault, then off the bus
    fake_nvml.recovery[1] = 2
    fake_nvml.lost.add(1)  # and GPU 1 fell off the bus
    r = source.read()
    assert r["gpu_throttle_reasons[0]"] == "sw_power_cap,hw_thermal_slowdown"
    assert r["gpu_throttle_hw[0]"] == 1
    assert (r["gpu_xid_events[0]"], r["gpu_xid_hw_events[0]"], r["gpu_xid_last[0]"]) == (2, 1, 79)
    assert r["gpu_lost[1]"] == 1 and r["gpu_temperature_c[1]"] == "unavailable"
    ev = default_policy().evaluate(r)
    assert ev.state == "critical"
    assert ev.reasons == (
        "gpu1 is lost (fallen off the bus) (critical)",
        "gpu0 uncorrected ECC errors since driver load 1 >= degraded 1",
        "gpu0 has row remappings pending (needs a GPU reset) (degraded)",
        "gpu0 hardware clock slowdown (sw_power_cap,hw_thermal_slowdown) (degraded)",
        "gpu0 hardware XID events (last XID 79) 1 >= degraded 1",
    )
    source.close()


def test_nvml_devices_by_uuid(fake_nvml: FakeNvml) -> None:
    source = NvmlSource(["8f0d-1"], nvml=fake_nvml)  # torch's uuid has no "GPU-" prefix
    assert source.devices == ["1"]
    assert "gpu_temperature_c[1]" in source.read()
    source.close()


def test_nvml_with_no_device_is_unavailable() -> None:
    fake = FakeNvml(count=0)
    source = NvmlSource(nvml=fake)
    assert not source.available and source.unavailable_reason == "NVML sees no GPU"
    assert fake.shutdowns == 1
    assert set(source.read().values()) == {"unavailable"}


def test_decode_throttle_reasons() -> None:
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x1 | 0x80) == ["gpu_idle", "hw_power_brake_slowdown"]
    assert decode_throttle_reasons(0x8 | 0x1000) == ["hw_slowdown", "0x1000"]


def test_host_source_returns_numbers(tmp_path: Path) -> None:
    not_yet = tmp_path / "cache" / "not-created-yet"
    source = HostSource([tmp_path, not_yet])
    r = source.read()
    for key in ("host_memory_percent", "host_swap_percent", "host_cpu_percent"):
        assert isinstance(r[key], float) and 0.0 <= r[key] <= 100.0, key  # type: ignore[operator]
    for path in (tmp_path, not_yet):
        free = r[f"disk_free_percent[{path}]"]
        assert isinstance(free, float) and 0.0 <= free <= 100.0
        assert isinstance(r[f"disk_free_gib[{path}]"], float)


def test_default_sources_build_a_working_probe(tmp_path: Path, recorder: Recorder) -> None:
    policy = parse_policy("[probe]\nstep_window = 7\nstep_min_samples = 2\n")
    sources = default_sources(policy, disk_paths=[tmp_path])
    assert [type(s) for s in sources] == [NvmlSource, HostSource, LoopSource, RttSource]
    with HealthProbe(policy, sources, on_action=recorder) as probe:
        probe.record_step(1, loss=3.0)
        probe.record_rtt(4.0)
        status = probe.evaluate_now()
    assert status.signals["probe_source_errors"] == 0
    assert status.signals["last_step"] == 1 and status.signals["server_rtt_ms"] == 4.0
    assert f"disk_free_percent[{tmp_path}]" in status.signals
    json.dumps(status.to_json(), allow_nan=False)



class SlowSource(ReadingSource):
    """A source that takes a while on its first read (NVML, psutil), so that the
    loop reports its NaN while the probe thread is mid-evaluation."""

    name = "slow"

    def __init__(self) -> None:
        self.entered = threading.Event()

    def read(self) -> dict[str, Any]:
        if not self.entered.is_set():
            self.entered.set()
            time.sleep(0.3)
        return {}


def test_a_nan_reported_while_the_probe_thread_evaluates_raises_in_that_step(
    tmp_path: Path,
) -> None:
    """docs/policy.md: the rollback is asked for before ``step`` returns, even when
    the probe thread reads the loss first (it never takes the rollback action)."""
    from ckptd.client.health.agent import HealthAgent

    slow = SlowSource()
    threads: list[str] = []
    agent = HealthAgent(f"file://{tmp_path}", "j", 0, 1,
                        sources=[slow, LoopSource(), RttSource()], latest=lambda: 7)
    dispatch = agent.probe._on_action

    def on_action(action: Action) -> None:
        threads.append(threading.current_thread().name)
        assert dispatch is not None
        dispatch(action)

    agent.probe._on_action = on_action
    agent.start()
    try:
        assert slow.entered.wait(5)
        with pytest.raises(RollbackRequested) as raised:
            agent.step(10, loss=math.nan)
        assert (raised.value.step, raised.value.rollback_to) == (10, 7)
        assert threads == [threading.current_thread().name]
        agent.step(11, loss=math.nan)  # told once: the next step goes on
    finally:
        agent.close()


class LostAtStartNvml(FakeNvml):
    """Devices already lost (or unopenable) when the probe starts: the handle
    lookup itself fails."""

    def __init__(self, count: int, lost: set[int], broken: set[int] | None = None) -> None:
        super().__init__(count)
        self.lost_at_start = lost
        self.broken = broken or set()

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, int]:
        if i in self.lost_at_start:
            raise FakeNvmlError(self.NVML_ERROR_GPU_IS_LOST)
        if i in self.broken:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)
        return ("handle", i)


def test_a_gpu_lost_before_the_probe_starts_reads_lost() -> None:
    source = NvmlSource(nvml=LostAtStartNvml(1, {0}))
    assert source.available and source.devices == ["0"]
    r = source.read()
    assert r["gpu_lost[0]"] == 1
    assert r["gpu_temperature_c[0]"] == "unavailable"
    status = HealthProbe(default_policy(), [source]).evaluate_now()
    assert status.state == "critical"  # gpu_lost's default
    assert status.reasons == ("gpu0 is lost (fallen off the bus) (critical)",)


def test_each_gpu_is_opened_on_its_own() -> None:
    source = NvmlSource(nvml=LostAtStartNvml(3, {1}, broken={2}))
    assert source.devices == ["0", "1"]  # 2 could not be opened: skipped, logged
    r = source.read()
    assert (r["gpu_lost[0]"], r["gpu_lost[1]"]) == (0, 1)
    assert r["gpu_temperature_c[0]"] == 65.0
    assert "gpu_lost[2]" not in r
    nothing = NvmlSource(nvml=LostAtStartNvml(1, set(), broken={0}))
    assert not nothing.available
    assert "could not open" in (nothing.unavailable_reason or "")
    assert set(nothing.read().values()) == {"unavailable"}


def test_time_the_loop_waited_in_ckptd_is_not_step_time(clock: FakeClock) -> None:
    """A save() that held the loop (its copy, or the last save still uploading to a
    slow store) is ckptd's time, not the node's: the step is timed without it, so
    a slow store does not read as a slow node (and ask for one more snapshot)."""
    loop = LoopSource(window=10, min_samples=2, clock=clock)
    loop.exclude(5.0)  # before any step: nothing to take it from
    loop.record_step(0)
    for step in (1, 2):
        clock.advance(1.0)
        loop.record_step(step)
    clock.advance(9.0)
    loop.exclude(6.0)  # inside save()
    loop.exclude(2.0)  # and once more (the snapshot step() took)
    loop.record_step(3)
    assert loop.read()["step_time_s"] == 1.0 and loop.read()["step_time_ratio"] == 1.0
    clock.advance(4.0)  # the wait is not carried into the next step
    loop.record_step(4)
    assert loop.read()["step_time_s"] == 4.0 and loop.read()["step_time_ratio"] == 4.0
    clock.advance(1.0)
    loop.exclude(3.0)  # more than the step took (clocks apart): never below 0
    loop.record_step(5)
    assert loop.read()["step_time_s"] == 0.0


def test_a_loss_that_is_no_number_is_one_line() -> None:
    """(Found by a probe.) ``step(1, loss="x")`` raised float()'s bare ValueError."""
    import torch

    from ckptd.errors import InvalidRequest

    loop = LoopSource()
    for bad in ("x", torch.ones(3), object()):
        with pytest.raises(InvalidRequest, match="must be a number"):
            loop.record_step(1, bad)  # type: ignore[arg-type]
    assert loop.record_step(1, torch.tensor(0.5)) is True
