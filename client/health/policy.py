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

import difflib
import json
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, cast

from ckptd.errors import InvalidPolicy

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
_ALLOWED_ACTIONS: Final[dict[str, tuple[ActionName, ...]]] = {
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
               "seconds between the last two reported steps", " s"),
    SignalSpec("step_time_median_s", "loop", "number", "median step time",
               "rolling median of step times over [probe] step_window steps", " s"),
    SignalSpec("step_time_ratio", "loop", "number", "step time",
               "the last step time over the rolling median of the steps before it",
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


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How often the probe reads, and how it judges step times."""

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


def _fmt(value: object) -> str:
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
        return _fmt(signals.get(signal_key(name, instance)))

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
    shown = _fmt(value)
    names = dict(spec.value_names)
    if value.is_integer() and int(value) in names:
        shown = f"{shown} ({names[int(value)]})"
    op = ">=" if direction == "above" else "<="
    return f"{label} {shown}{spec.unit} {op} {level} {_fmt(threshold)}"


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


# -- TOML in: where a key sits ----------------------------------------------------------

_KEY_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_KEY_PATH = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_HEADER = re.compile(rf"^\s*\[\[?\s*({_KEY_PATH})\s*\]\]?\s*(?:#.*)?$")
_KEY_LINE = re.compile(rf"^\s*({_KEY_PATH})\s*=(.*)$")
_PART = re.compile(_KEY_PART)


def _key_parts(path: str) -> tuple[str, ...]:
    parts = []
    for token in _PART.findall(path):
        if token[:1] == '"':
            token = json.loads(token)
        elif token[:1] == "'":
            token = token[1:-1]
        parts.append(token)
    return tuple(parts)


class _Locator:
    """Finds the line that defines a key path, for error messages.

    A small line scanner, not a TOML parser: it knows ``[table]`` headers,
    ``key = value`` and dotted keys, and keys inside a one-line inline table.
    """

    def __init__(self, text: str) -> None:
        self._entries: list[tuple[int, tuple[str, ...], str]] = []
        table: tuple[str, ...] = ()
        in_multiline = False
        for lineno, line in enumerate(text.splitlines(), start=1):
            quotes = line.count('"""') + line.count("'''")
            if in_multiline:
                in_multiline = quotes % 2 == 0
                continue
            if quotes % 2 == 1:
                in_multiline = True
            if m := _HEADER.match(line):
                table = _key_parts(m.group(1))
                self._entries.append((lineno, table, ""))
            elif m := _KEY_LINE.match(line):
                self._entries.append((lineno, table + _key_parts(m.group(1)), m.group(2)))

    def line_of(self, path: tuple[str, ...]) -> int | None:
        """The line defining ``path``, else the line of its longest defined prefix."""
        best: tuple[int, int] | None = None  # (prefix length, line)
        for lineno, defined, rest in self._entries:
            if defined == path:
                return lineno
            n = len(defined)
            if n < len(path) and path[:n] == defined:
                inner = re.escape(path[n])
                if rest and re.search(rf"(?:^|[{{,\s]){inner}\s*=", rest):
                    return lineno
                if best is None or n > best[0]:
                    best = (n, lineno)
        return best[1] if best else None


# -- TOML in: the schema ----------------------------------------------------------------


_TOP_KEYS = ("version", "probe", "actions", "signals")
_PROBE_KEYS = ("interval_s", "step_window", "step_min_samples")
_ACTION_KEYS = ("degraded", "critical", "nonfinite_loss", "snapshot_min_interval_s")
_SIGNAL_KEYS = ("direction", "degraded", "critical")


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: object) -> str:
    names = {bool: "a boolean", str: "a string", list: "an array", dict: "a table",
             int: "an integer", float: "a float"}
    return names.get(type(value), f"a {type(value).__name__}")


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.locator = _Locator(text)
        self.problems: list[tuple[int | None, str, str]] = []

    def problem(self, path: tuple[str, ...], reason: str) -> None:
        self.problems.append((self.locator.line_of(path), ".".join(path), reason))

    def number(self, path: tuple[str, ...], value: object, *, minimum: float,
               strict: bool, integer: bool = False) -> float | None:
        want = "an integer" if integer else "a number"
        ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type:
            self.problem(path, f"{path[-1]} must be {want}, not {_type_name(value)}")
            return None
        number = float(cast(float, value))
        if not math.isfinite(number):
            self.problem(path, f"{path[-1]} must be finite, not {value}")
            return None
        if number < minimum or (strict and number == minimum):
            bound = ">" if strict else ">="
            self.problem(path, f"{path[-1]} must be {bound} {_fmt(minimum)}, not {value}")
            return None
        return number

    def table(self, path: tuple[str, ...], value: object) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            name = ".".join(path)
            self.problem(path, f"{name} must be a table ([{name}]), not {_type_name(value)}")
            return None
        return value

    def unknown(self, path: tuple[str, ...], key: str, known: Iterable[str]) -> None:
        where = f" in [{'.'.join(path)}]" if path else ""
        known = list(known)
        self.problem(path + (key,), f"unknown key {key!r}{where}{_suggest(key, known)}; "
                                    f"known: {', '.join(known)}")

    def build(self, data: dict[str, Any]) -> Policy:
        base = default_policy()
        for key, value in data.items():
            if key in _TOP_KEYS:
                continue
            if isinstance(value, dict):
                self.problem((key,), f"unknown section [{key}]{_suggest(key, _TOP_KEYS)}; "
                                     f"known: {', '.join(_TOP_KEYS[1:])}")
            else:
                self.unknown((), key, _TOP_KEYS)
        if "version" in data:
            version = data["version"]
            if isinstance(version, bool) or version != POLICY_VERSION:
                self.problem(("version",), f"unsupported policy version {version!r}; "
                                           f"this ckptd reads version {POLICY_VERSION}")
        probe = self.probe(data.get("probe", {}), base.probe)
        actions = self.actions(data.get("actions", {}), base.actions)
        thresholds = self.signals(data.get("signals", {}), base.thresholds)
        return Policy(thresholds=thresholds, probe=probe, actions=actions, source=self.source)

    def probe(self, raw: object, base: ProbeSettings) -> ProbeSettings:
        section = self.table(("probe",), raw)
        if section is None:
            return base
        for key in section:
            if key not in _PROBE_KEYS:
                self.unknown(("probe",), key, _PROBE_KEYS)
        interval = base.interval_s
        window = base.step_window
        samples = base.step_min_samples
        if "interval_s" in section:
            v = self.number(("probe", "interval_s"), section["interval_s"], minimum=0,
                            strict=True)
            interval = interval if v is None else v
        if "step_window" in section:
            v = self.number(("probe", "step_window"), section["step_window"], minimum=2,
                            strict=False, integer=True)
            window = window if v is None else int(v)
        if "step_min_samples" in section:
            v = self.number(("probe", "step_min_samples"), section["step_min_samples"],
                            minimum=1, strict=False, integer=True)
            samples = samples if v is None else int(v)
        if samples > window:
            key = "step_min_samples" if "step_min_samples" in section else "step_window"
            self.problem(("probe", key), f"step_min_samples ({samples}) must be <= "
                                         f"step_window ({window})")
        return ProbeSettings(interval, window, samples)

    def actions(self, raw: object, base: ActionSettings) -> ActionSettings:
        section = self.table(("actions",), raw)
        if section is None:
            return base
        for key in section:
            if key not in _ACTION_KEYS:
                self.unknown(("actions",), key, _ACTION_KEYS)
        lists: dict[str, tuple[ActionName, ...]] = {
            "degraded": base.degraded,
            "critical": base.critical,
            "nonfinite_loss": base.nonfinite_loss,
        }
        for key in lists:
            if key in section:
                parsed = self.action_list(("actions", key), section[key])
                if parsed is not None:
                    lists[key] = parsed
        interval = base.snapshot_min_interval_s
        if "snapshot_min_interval_s" in section:
            v = self.number(("actions", "snapshot_min_interval_s"),
                            section["snapshot_min_interval_s"], minimum=0, strict=False)
            interval = interval if v is None else v
        return ActionSettings(lists["degraded"], lists["critical"], lists["nonfinite_loss"],
                              interval)

    def action_list(self, path: tuple[str, ...], value: object) -> tuple[ActionName, ...] | None:
        key = path[-1]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.problem(path, f"{key} must be an array of action names, e.g. "
                               f"[\"snapshot\"], not {_type_name(value)}")
            return None
        allowed = _ALLOWED_ACTIONS[key]
        out: list[ActionName] = []
        for name in cast(list[str], value):
            if name not in ACTION_NAMES:
                self.problem(path, f"unknown action {name!r}{_suggest(name, ACTION_NAMES)}; "
                                   f"known: {', '.join(ACTION_NAMES)}")
            elif name == "snapshot" and key == "nonfinite_loss":
                self.problem(path, "'snapshot' is not allowed in nonfinite_loss: a non-finite "
                                   "loss never snapshots the poisoned state")
            elif name not in allowed:
                self.problem(path, f"{name!r} is not allowed in {key}; allowed: "
                                   f"{', '.join(allowed)}")
            elif name in out:
                self.problem(path, f"action {name!r} is listed twice in {key}")
            else:
                out.append(name)
        return tuple(out)

    def signals(self, raw: object, base: Mapping[str, SignalThreshold]
                ) -> dict[str, SignalThreshold]:
        merged = dict(base)
        section = self.table(("signals",), raw)
        if section is None:
            return merged
        for name, body in section.items():
            path = ("signals", name)
            spec = SIGNALS.get(name)
            if spec is None:
                self.problem(path, f"unknown signal {name!r}{_suggest(name, SIGNALS)}")
                continue
            if spec.kind == "info":
                self.problem(path, f"signal {name!r} is informational and takes no thresholds")
                continue
            table = self.table(path, body)
            if table is None:
                continue
            threshold = self.threshold(path, table, merged[name])
            if threshold is not None:
                merged[name] = threshold
        return merged

    def threshold(self, path: tuple[str, ...], table: dict[str, Any],
                  base: SignalThreshold) -> SignalThreshold | None:
        ok = True
        for key in table:
            if key not in _SIGNAL_KEYS:
                self.unknown(path, key, _SIGNAL_KEYS)
                ok = False
        direction: Direction = base.direction
        if "direction" in table:
            raw = table["direction"]
            if raw in ("above", "below"):
                direction = cast(Direction, raw)
            else:
                self.problem(path + ("direction",),
                             f"direction must be \"above\" or \"below\", not {raw!r}")
                ok = False
        levels: dict[str, float | None] = {"degraded": base.degraded, "critical": base.critical}
        for level in levels:
            if level not in table:
                continue
            raw = table[level]
            if raw == "off":
                levels[level] = None
            elif isinstance(raw, bool) or not isinstance(raw, int | float):
                self.problem(path + (level,), f"{level} threshold must be a number or "
                                              f"\"off\", not {_type_name(raw)} {raw!r}")
                ok = False
            elif not math.isfinite(raw):
                self.problem(path + (level,), f"{level} threshold must be finite, not {raw}")
                ok = False
            else:
                levels[level] = float(raw)
        degraded, critical = levels["degraded"], levels["critical"]
        if ok and degraded is not None and critical is not None:
            inverted = degraded > critical if direction == "above" else degraded < critical
            if inverted:
                word = "above" if direction == "above" else "below"
                defaults = [k for k in ("degraded", "critical") if k not in table]
                note = f" ({' and '.join(defaults)} from the defaults)" if defaults else ""
                where = "degraded" if "degraded" in table else "critical"
                if "direction" in table and len(defaults) == 2:
                    where = "direction"
                self.problem(path + (where,),
                             f"degraded {_fmt(degraded)} is {word} critical {_fmt(critical)} "
                             f"for {'an' if direction == 'above' else 'a'} \"{direction}\" "
                             f"signal{note}: the degraded threshold must be crossed first")
                ok = False
        return SignalThreshold(direction, degraded, critical) if ok else None


_AT_LINE = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_AT_END = re.compile(r"\s*\(at end of document\)\s*$")


def _syntax_error(exc: tomllib.TOMLDecodeError, text: str, source: str) -> InvalidPolicy:
    message = str(exc.args[0]) if exc.args else str(exc)
    line: int | None = getattr(exc, "lineno", None)
    column: int | None = getattr(exc, "colno", None)
    reason = getattr(exc, "msg", None) or message
    if m := _AT_LINE.search(message):
        line, column = int(m.group(1)), int(m.group(2))
        reason = message[: m.start()]
    elif m := _AT_END.search(message):
        line, column = max(1, len(text.splitlines())), None
        reason = message[: m.start()] + " at end of file"
    reason = f"TOML syntax error: {reason}"
    where = f"{source}:{line}" + (f":{column}" if column else "")
    return InvalidPolicy(
        f"{where}: {reason}",
        source=source, line=line, column=column, reason=reason,
        problems=[{"line": line, "key": None, "reason": reason}],
    )


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """A policy from TOML text, defaults merged; ``InvalidPolicy`` names line and reason."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _syntax_error(exc, text, source) from None
    parser = _Parser(text, source)
    policy = parser.build(data)
    if not parser.problems:
        return policy
    problems = sorted(parser.problems, key=lambda p: (p[0] is None, p[0] or 0))
    line, key, reason = problems[0]
    lines = [f"{source}:{ln if ln is not None else '?'}: {why}" for ln, _, why in problems]
    raise InvalidPolicy(
        "\n".join(lines),
        source=source, line=line, column=None, key=key, reason=reason,
        problems=[{"line": ln, "key": k, "reason": why} for ln, k, why in problems],
    )


def load_policy(path: str | Path) -> Policy:
    """The policy in the TOML file at ``path``, defaults merged."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = f"cannot read policy file: {exc}"
        raise InvalidPolicy(f"{path}: {reason}", source=str(path), line=None, column=None,
                            reason=reason, problems=[], unreadable=True) from None
    return parse_policy(text, source=str(path))


def check_command(path: str) -> tuple[int, str]:
    """What ``ckptd policy check FILE`` prints, and its exit code.

    0 and the effective policy (defaults merged) when the file is valid; 1 and one
    ``FILE:LINE: reason`` line per problem when it is not; 2 when it cannot be read.
    """
    try:
        policy = load_policy(path)
    except InvalidPolicy as exc:
        return (2 if exc.detail.get("unreadable") else 1), str(exc)
    return 0, policy.effective_toml()
