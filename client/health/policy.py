"""The health policy: thresholds per signal and what each level does.

A policy is a TOML file (``docs/policy.md`` documents every key); without one,
``default_policy()`` holds defaults that make sense for a GPU training job.
``Policy.evaluate`` turns one set of signal readings into a state
(``ok`` / ``degraded`` / ``critical``), human reasons and the actions that state
asks for. It is pure: rate limits and "only once" belong to the probe that calls it.

Signal keys are a catalog name, optionally followed by an instance in brackets:
``gpu_temperature_c[0]`` is GPU 0's temperature, ``disk_free_percent[/dev/shm]``
the free space where the staging pool lives. Thresholds are per catalog name and
apply to every instance.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, cast

Level = Literal["ok", "degraded", "critical"]
Direction = Literal["above", "below"]
ActionName = Literal["snapshot", "report_failing", "rollback"]
SignalKind = Literal["number", "flag", "info"]
SignalValue = float | int | str | None

LEVELS: Final[tuple[Level, ...]] = ("ok", "degraded", "critical")
ACTION_NAMES: Final[tuple[ActionName, ...]] = ("snapshot", "report_failing", "rollback")
UNAVAILABLE: Final = "unavailable"
POLICY_VERSION: Final = 1

# Which actions each list in [actions] may hold. A non-finite loss never snapshots
# the poisoned state; rolling back is only ever an answer to a non-finite loss.
ALLOWED_ACTIONS: Final[dict[str, tuple[ActionName, ...]]] = {
    "degraded": ("snapshot", "report_failing"),
    "critical": ("snapshot", "report_failing"),
    "nonfinite_loss": ("rollback", "report_failing"),
}


# -- the signal catalog -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One signal the probe reports: how to read it and its default thresholds.

    ``label`` is a template: ``{i}`` is the instance (GPU index, disk path) and
    ``{name}`` the same instance's reading of signal ``name``.
    """

    name: str
    group: Literal["gpu", "host", "loop", "server", "probe"]
    kind: SignalKind
    label: str
    doc: str
    unit: str = ""
    direction: Direction = "above"
    degraded: float | None = None
    critical: float | None = None
    value_names: tuple[tuple[int, str], ...] = ()


_RECOVERY_ACTIONS = (
    (0, "none"),
    (1, "gpu_reset"),
    (2, "node_reboot"),
    (3, "drain_p2p"),
    (4, "drain_and_reset"),
    (5, "recover_imex_domain"),
    (6, "bus_reset"),
    (7, "system_reboot"),
)

CATALOG: Final[tuple[SignalSpec, ...]] = (
    # GPU, per device (NVML); "unavailable" without NVML or a GPU.
    SignalSpec("gpu_temperature_c", "gpu", "number", "gpu{i} temperature",
               "GPU core temperature", " C", degraded=85, critical=95),
    SignalSpec("gpu_power_w", "gpu", "number", "gpu{i} power", "board power draw", " W"),
    SignalSpec("gpu_utilization_percent", "gpu", "number", "gpu{i} utilization",
               "percent of time a kernel ran over the last sample period", "%"),
    SignalSpec("gpu_memory_used_percent", "gpu", "number", "gpu{i} memory used",
               "device memory used", "%"),
    SignalSpec("gpu_ecc_uncorrected_volatile", "gpu", "number",
               "gpu{i} uncorrected ECC errors since driver load",
               "uncorrected ECC errors since the driver loaded", degraded=1, critical=10),
    SignalSpec("gpu_ecc_uncorrected_aggregate", "gpu", "number",
               "gpu{i} uncorrected ECC errors (lifetime)",
               "uncorrected ECC errors over the board's life (no default: old errors "
               "would keep a healthy GPU degraded)"),
    SignalSpec("gpu_retired_pages", "gpu", "number", "gpu{i} retired pages",
               "pages retired for single- or double-bit ECC errors (pre-Ampere)"),
    SignalSpec("gpu_retired_pages_pending", "gpu", "flag",
               "gpu{i} has pages pending retirement (needs a GPU reset)",
               "1 when retired pages wait for a reset to take effect", degraded=1),
    SignalSpec("gpu_remapped_rows_pending", "gpu", "flag",
               "gpu{i} has row remappings pending (needs a GPU reset)",
               "1 when remapped rows wait for a reset (Ampere and later)", degraded=1),
    SignalSpec("gpu_remapped_rows_failed", "gpu", "flag", "gpu{i} row remapping failed",
               "1 when a row remapping failed: the GPU should be replaced", critical=1),
    SignalSpec("gpu_throttle_hw", "gpu", "flag",
               "gpu{i} hardware clock slowdown ({gpu_throttle_reasons})",
               "1 when clocks are held down by hardware slowdown, hardware thermal "
               "slowdown or the power brake", degraded=1),
    SignalSpec("gpu_throttle_reasons", "gpu", "info", "gpu{i} clock event reasons",
               "active clock throttle reasons, comma separated (e.g. sw_power_cap)"),
    SignalSpec("gpu_xid_events", "gpu", "number", "gpu{i} XID events",
               "XID critical-error events seen since the probe started"),
    SignalSpec("gpu_xid_hw_events", "gpu", "number",
               "gpu{i} hardware XID events (last XID {gpu_xid_last})",
               "XID events whose code names a hardware or driver fault "
               "(48 61 62 63 64 74 79 92 94 95 119 120) since the probe started",
               degraded=1),
    SignalSpec("gpu_xid_last", "gpu", "info", "gpu{i} last XID",
               "code of the last XID event seen, or null"),
    SignalSpec("gpu_recovery_action", "gpu", "number", "gpu{i} recovery action",
               "the recovery the driver asks for: 0 none, 1 gpu_reset, 2 node_reboot, "
               "3 drain_p2p, 4 drain_and_reset, 5 recover_imex_domain, 6 bus_reset, "
               "7 system_reboot", critical=1, value_names=_RECOVERY_ACTIONS),
    SignalSpec("gpu_lost", "gpu", "flag", "gpu{i} is lost (fallen off the bus)",
               "1 when NVML answers 'GPU is lost'", critical=1),
    # Host (psutil).
    SignalSpec("host_memory_percent", "host", "number", "host memory used",
               "host memory in use (total - available), shared memory included", "%",
               degraded=92, critical=98),
    SignalSpec("host_swap_percent", "host", "number", "host swap used", "swap in use", "%"),
    SignalSpec("host_cpu_percent", "host", "number", "host CPU",
               "CPU busy across all cores since the last reading", "%"),
    SignalSpec("disk_free_percent", "host", "number", "disk {i} free",
               "free space of the file system holding each watched path", "%",
               direction="below", degraded=5, critical=2),
    SignalSpec("disk_free_gib", "host", "number", "disk {i} free",
               "free space of the file system holding each watched path", " GiB",
               direction="below"),
    # The training loop (ckpt.step(step, loss=...)).
    SignalSpec("last_step", "loop", "info", "last step", "the last step the loop reported"),
    SignalSpec("step_time_s", "loop", "number", "step time",
               "seconds between the last two reported steps, less the time the loop "
               "spent in ckptd's save()", " s"),
    SignalSpec("step_time_median_s", "loop", "number", "median step time",
               "rolling median of step times over [probe] step_window steps", " s"),
    SignalSpec("step_time_ratio", "loop", "number", "step time",
               "the last step time over the rolling median of the steps before it, read at "
               "each probe interval (a slowdown that lasts is seen; one slow step among fast "
               "ones may fall between two readings)",
               "x median", degraded=3.0),
    SignalSpec("seconds_since_step", "loop", "number", "no step for",
               "seconds since the loop last reported a step, measured by the probe "
               "thread (so a stalled loop is seen); null before the first step", " s",
               degraded=300, critical=1800),
    SignalSpec("loss", "loop", "info", "loss",
               "the last loss reported; \"nan\", \"inf\" or \"-inf\" when non-finite"),
    SignalSpec("loss_nonfinite", "loop", "flag",
               "loss became non-finite at step {loss_nonfinite_step}",
               "1 from a NaN/Inf loss until the loop is reset after a rollback; "
               "always runs [actions] nonfinite_loss, whatever its thresholds",
               degraded=1),
    SignalSpec("loss_nonfinite_step", "loop", "info", "non-finite loss step",
               "the step at which the loss became non-finite, or null"),
    # The server.
    SignalSpec("server_rtt_ms", "server", "number", "server round trip",
               "round trip of the last heartbeat that got an answer", " ms", degraded=2000),
    SignalSpec("server_heartbeat_failures", "server", "number",
               "heartbeats failed in a row", "heartbeats that failed in a row"),
    # The probe itself.
    SignalSpec("probe_source_errors", "probe", "number", "probe sources failing",
               "reading sources whose last read raised (each is also named in reasons)"),
)

SIGNALS: Final[dict[str, SignalSpec]] = {spec.name: spec for spec in CATALOG}
GPU_SIGNALS: Final[tuple[str, ...]] = tuple(s.name for s in CATALOG if s.group == "gpu")
_ORDER: Final[dict[str, int]] = {spec.name: i for i, spec in enumerate(CATALOG)}


def split_signal_key(key: str) -> tuple[str, str | None]:
    """``"gpu_temperature_c[0]"`` -> ``("gpu_temperature_c", "0")``."""
    if key.endswith("]") and "[" in key:
        name, _, rest = key.partition("[")
        return name, rest[:-1]
    return key, None


def signal_key(name: str, instance: str | int | None = None) -> str:
    """The reading key of catalog signal ``name`` for one instance (GPU, path)."""
    return name if instance is None else f"{name}[{instance}]"


# -- the policy -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SignalThreshold:
    """When one signal is degraded or critical (None: that level is off)."""

    direction: Direction
    degraded: float | None = None
    critical: float | None = None

    def level_of(self, value: float) -> tuple[Level, float] | None:
        """The worst level ``value`` crosses and its threshold, or None."""
        for level, threshold in (("critical", self.critical), ("degraded", self.degraded)):
            if threshold is None:
                continue
            crossed = value >= threshold if self.direction == "above" else value <= threshold
            if crossed:
                return cast(Level, level), threshold
        return None


# A probe that reads less often than hourly no longer watches anything, and the
# thread's wait takes no unbounded seconds (1e308 overflows it and ends the probe).
MAX_PROBE_INTERVAL_S = 3600.0


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How often the probe reads (at most every ``MAX_PROBE_INTERVAL_S``), and how
    it judges step times."""

    interval_s: float = 5.0
    step_window: int = 50
    step_min_samples: int = 5


@dataclass(frozen=True, slots=True)
class ActionSettings:
    """What each level asks for."""

    degraded: tuple[ActionName, ...] = ("snapshot",)
    critical: tuple[ActionName, ...] = ("snapshot", "report_failing")
    nonfinite_loss: tuple[ActionName, ...] = ("rollback",)
    snapshot_min_interval_s: float = 300.0

    def for_level(self, level: Level) -> tuple[ActionName, ...]:
        if level == "degraded":
            return self.degraded
        if level == "critical":
            return self.critical
        return ()


@dataclass(frozen=True, slots=True)
class Crossing:
    """One signal reading past one of its thresholds."""

    key: str
    signal: str
    level: Level
    value: float
    threshold: float
    reason: str


@dataclass(frozen=True, slots=True)
class Trigger:
    """Why an action applies; ``ident`` stays the same while the cause persists."""

    ident: str
    reason: str


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The verdict on one set of readings.

    ``actions`` is what the state asks for (a non-finite loss removes
    ``snapshot`` and adds ``[actions] nonfinite_loss``); ``triggers`` says which
    crossings ask for each action, so a caller can act on new causes only.
    """

    state: Level
    reasons: tuple[str, ...]
    actions: tuple[ActionName, ...]
    crossings: tuple[Crossing, ...] = ()
    triggers: Mapping[ActionName, tuple[Trigger, ...]] = field(default_factory=dict)
    nonfinite_step: int | None = None
    nonfinite: bool = False


def _default_thresholds() -> dict[str, SignalThreshold]:
    return {
        s.name: SignalThreshold(s.direction, s.degraded, s.critical)
        for s in CATALOG
        if s.kind != "info"
    }


@dataclass(frozen=True, slots=True)
class Policy:
    """A validated health policy, defaults merged."""

    thresholds: Mapping[str, SignalThreshold] = field(default_factory=_default_thresholds)
    probe: ProbeSettings = ProbeSettings()
    actions: ActionSettings = ActionSettings()
    source: str = field(default="<defaults>", compare=False)

    def evaluate(self, signals: Mapping[str, SignalValue]) -> Evaluation:
        """The state, reasons and actions for one set of readings.

        Readings that are None, text (``"unavailable"``) or not finite are skipped;
        keys that name no catalog signal are ignored.
        """
        crossings: list[Crossing] = []
        for key, value in signals.items():
            name, instance = split_signal_key(key)
            threshold = self.thresholds.get(name)
            number = _as_number(value)
            if threshold is None or number is None:
                continue
            hit = threshold.level_of(number)
            if hit is None:
                continue
            level, limit = hit
            reason = _describe(SIGNALS[name], instance, number, level, limit,
                               threshold.direction, signals)
            crossings.append(Crossing(key, name, level, number, limit, reason))
        crossings.sort(key=lambda c: (-LEVELS.index(c.level), _ORDER[c.signal], c.key))
        state: Level = crossings[0].level if crossings else "ok"

        nonfinite = (_as_number(signals.get("loss_nonfinite")) or 0) >= 1
        step_value = _as_number(signals.get("loss_nonfinite_step"))
        nonfinite_step = int(step_value) if nonfinite and step_value is not None else None

        triggers: dict[ActionName, list[Trigger]] = {}
        for c in crossings:
            for action in self.actions.for_level(c.level):
                triggers.setdefault(action, []).append(Trigger(f"{c.key}:{c.level}", c.reason))
        actions = list(self.actions.for_level(state))
        reasons = [c.reason for c in crossings]
        if nonfinite:
            # Never snapshot the poisoned state, whatever else asks for one.
            triggers.pop("snapshot", None)
            actions = [a for a in actions if a != "snapshot"]
            reason = _fill(SIGNALS["loss_nonfinite"].label, None, signals)
            if not any(c.signal == "loss_nonfinite" for c in crossings):
                reasons.append(reason)
            for action in self.actions.nonfinite_loss:
                triggers.setdefault(action, []).append(
                    Trigger(f"loss_nonfinite:{nonfinite_step}", reason)
                )
                actions.append(action)
        return Evaluation(
            state=state,
            reasons=tuple(reasons),
            actions=tuple(dict.fromkeys(actions)),
            crossings=tuple(crossings),
            triggers={a: tuple(ts) for a, ts in triggers.items()},
            nonfinite_step=nonfinite_step,
            nonfinite=nonfinite,
        )

    def effective_toml(self) -> str:
        """This policy as TOML, every key present: ``parse_policy`` reads it back equal."""
        out = [
            f"# ckptd health policy (effective: defaults merged with {self.source})",
            f"version = {POLICY_VERSION}",
            "",
            "[probe]",
            f"interval_s = {_toml_value(self.probe.interval_s)}",
            f"step_window = {_toml_value(self.probe.step_window)}",
            f"step_min_samples = {_toml_value(self.probe.step_min_samples)}",
            "",
            "[actions]",
            f"degraded = {_toml_value(list(self.actions.degraded))}",
            f"critical = {_toml_value(list(self.actions.critical))}",
            f"nonfinite_loss = {_toml_value(list(self.actions.nonfinite_loss))}",
            f"snapshot_min_interval_s = {_toml_value(self.actions.snapshot_min_interval_s)}",
        ]
        for spec in CATALOG:
            threshold = self.thresholds.get(spec.name)
            if threshold is None:
                continue
            unit = spec.unit.strip()
            out += [
                "",
                f"# {spec.doc}" + (f" ({unit})" if unit else ""),
                f"[signals.{spec.name}]",
                f"direction = {_toml_value(threshold.direction)}",
                f"degraded = {_toml_value(_off(threshold.degraded))}",
                f"critical = {_toml_value(_off(threshold.critical))}",
            ]
        return "\n".join(out) + "\n"


def default_policy() -> Policy:
    """The policy in force without a file."""
    return Policy()


# -- reasons --------------------------------------------------------------------------


def _as_number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def fmt_value(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return "?" if value is None else str(value)


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _fill(template: str, instance: str | None, signals: Mapping[str, SignalValue]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "i":
            return instance or ""
        return fmt_value(signals.get(signal_key(name, instance)))

    return " ".join(_PLACEHOLDER.sub(one, template).split())


def _describe(
    spec: SignalSpec,
    instance: str | None,
    value: float,
    level: Level,
    threshold: float,
    direction: Direction,
    signals: Mapping[str, SignalValue],
) -> str:
    label = _fill(spec.label, instance, signals)
    if spec.kind == "flag" and direction == "above" and threshold <= 1:
        return f"{label} ({level})"
    shown = fmt_value(value)
    names = dict(spec.value_names)
    if value.is_integer() and int(value) in names:
        shown = f"{shown} ({names[int(value)]})"
    op = ">=" if direction == "above" else "<="
    return f"{label} {shown}{spec.unit} {op} {level} {fmt_value(threshold)}"


# -- TOML out ---------------------------------------------------------------------------


def _off(value: float | None) -> float | str:
    return "off" if value is None else value


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
