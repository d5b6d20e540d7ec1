"""Reading a policy file: TOML in, checked against the schema, every mistake
named by line and column with a suggestion (``InvalidPolicy``); ``ckptd policy
check`` is ``check_command``. The policy itself is ``policy.py``."""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from ckptd.errors import InvalidPolicy

from .policy import (
    ACTION_NAMES,
    ALLOWED_ACTIONS,
    MAX_PROBE_INTERVAL_S,
    POLICY_VERSION,
    SIGNALS,
    ActionName,
    ActionSettings,
    Direction,
    Policy,
    ProbeSettings,
    SignalThreshold,
    default_policy,
    fmt_value,
)

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
        """The line defining ``path`` (or the first key under it, for a dotted key
        such as ``signals.x.degraded``), else the line of its longest defined prefix."""
        best: tuple[int, int] | None = None  # (prefix length, line)
        for lineno, defined, rest in self._entries:
            if defined[:len(path)] == path:
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
               strict: bool, integer: bool = False,
               maximum: float = math.inf) -> float | None:
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
            self.problem(path, f"{path[-1]} must be {bound} {fmt_value(minimum)}, not {value}")
            return None
        if number > maximum:
            self.problem(path, f"{path[-1]} must be <= {fmt_value(maximum)}, not {value}")
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
            if isinstance(version, bool) or not isinstance(version, int):
                self.problem(("version",), f"version must be an integer ({POLICY_VERSION}), "
                                           f"not {_type_name(version)} {version!r}")
            elif version != POLICY_VERSION:
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
                            strict=True, maximum=MAX_PROBE_INTERVAL_S)
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
        allowed = ALLOWED_ACTIONS[key]
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
                             f"degraded {fmt_value(degraded)} is {word} critical "
                             f"{fmt_value(critical)} "
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
