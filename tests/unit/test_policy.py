"""The health policy: defaults, parsing, refusals with line and reason, evaluation,
the effective policy as TOML, and ``ckptd policy check``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.client.health.policy import (
    CATALOG,
    GPU_SIGNALS,
    SIGNALS,
    ActionSettings,
    Policy,
    ProbeSettings,
    SignalThreshold,
    default_policy,
    split_signal_key,
)
from ckptd.client.health.policy_file import check_command, load_policy, parse_policy
from ckptd.errors import CkptdError, InvalidPolicy, InvalidRequest

EXAMPLE = """\
# a policy for a cluster with hot GPUs
version = 1

[probe]
interval_s = 2.5
step_window = 20

[actions]
degraded = ["snapshot"]
critical = ["snapshot", "report_failing"]
nonfinite_loss = ["rollback", "report_failing"]
snapshot_min_interval_s = 120

[signals.gpu_temperature_c]
degraded = 88            # critical stays at the default

[signals.disk_free_percent]
direction = "below"
degraded = 10
critical = 3

[signals.seconds_since_step]
critical = "off"

[signals.gpu_utilization_percent]
direction = "below"      # an idle GPU in a training job is a stalled rank
degraded = 5
"""


# -- defaults and parsing ---------------------------------------------------------------


def test_defaults_make_sense_without_a_file() -> None:
    policy = default_policy()
    assert policy.probe == ProbeSettings(interval_s=5.0, step_window=50, step_min_samples=5)
    assert policy.actions == ActionSettings(
        degraded=("snapshot",),
        critical=("snapshot", "report_failing"),
        nonfinite_loss=("rollback",),
        snapshot_min_interval_s=300.0,
    )
    t = policy.thresholds
    assert t["gpu_temperature_c"] == SignalThreshold("above", 85, 95)
    assert t["gpu_ecc_uncorrected_volatile"] == SignalThreshold("above", 1, 10)
    assert t["gpu_retired_pages_pending"] == SignalThreshold("above", 1, None)
    assert t["disk_free_percent"] == SignalThreshold("below", 5, 2)
    assert t["step_time_ratio"] == SignalThreshold("above", 3.0, None)
    assert t["loss_nonfinite"].degraded == 1
    # A lifetime counter has no default: old errors would keep a healthy GPU degraded.
    assert t["gpu_ecc_uncorrected_aggregate"] == SignalThreshold("above", None, None)
    # Informational signals take no thresholds at all.
    assert "gpu_throttle_reasons" not in t and "loss" not in t
    assert parse_policy("") == policy
    assert parse_policy("# nothing but a comment\n") == policy


def test_every_default_is_ordered() -> None:
    for spec in CATALOG:
        if spec.degraded is not None and spec.critical is not None:
            if spec.direction == "above":
                assert spec.degraded <= spec.critical, spec.name
            else:
                assert spec.degraded >= spec.critical, spec.name
    assert set(GPU_SIGNALS) == {s.name for s in CATALOG if s.group == "gpu"}


def test_parse_merges_file_over_defaults_key_by_key() -> None:
    policy = parse_policy(EXAMPLE, source="hot.toml")
    assert policy.source == "hot.toml"
    assert policy.probe == ProbeSettings(interval_s=2.5, step_window=20, step_min_samples=5)
    assert policy.actions.nonfinite_loss == ("rollback", "report_failing")
    assert policy.actions.snapshot_min_interval_s == 120
    assert policy.thresholds["gpu_temperature_c"] == SignalThreshold("above", 88, 95)
    assert policy.thresholds["disk_free_percent"] == SignalThreshold("below", 10, 3)
    assert policy.thresholds["seconds_since_step"] == SignalThreshold("above", 300, None)
    assert policy.thresholds["gpu_utilization_percent"] == SignalThreshold("below", 5, None)
    # Untouched signals keep their defaults.
    assert policy.thresholds["host_memory_percent"] == SignalThreshold("above", 92, 98)


def test_dotted_keys_and_inline_tables_are_the_same_policy() -> None:
    a = parse_policy("[signals.gpu_temperature_c]\ndegraded = 80\ncritical = 90\n")
    b = parse_policy("signals.gpu_temperature_c.degraded = 80\n"
                     "signals.gpu_temperature_c.critical = 90\n")
    c = parse_policy("[signals]\ngpu_temperature_c = { degraded = 80, critical = 90 }\n")
    assert a == b == c
    assert a.thresholds["gpu_temperature_c"] == SignalThreshold("above", 80, 90)


def test_load_policy_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(EXAMPLE)
    policy = load_policy(path)
    assert policy == parse_policy(EXAMPLE)
    assert policy.source == str(path)


def test_load_policy_refuses_a_missing_or_undecodable_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidPolicy) as missing:
        load_policy(tmp_path / "nope.toml")
    assert missing.value.line is None and "cannot read policy file" in missing.value.reason
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"# caf\xe9\n")
    with pytest.raises(InvalidPolicy, match="cannot read policy file"):
        load_policy(path)


# -- refusals: the line and the reason -------------------------------------------------

MALFORMED = [
    pytest.param("[probe]\ninterval_s = 5\nstep_window = \n", 3, "TOML syntax error: Invalid value",
                 id="syntax-error"),
    pytest.param("[signals.gpu_temperature_c]\ndegraded = 80\ndegraded = 81\n", 3,
                 "TOML syntax error", id="duplicate-key"),
    pytest.param("[actions]\ndegraded = [\"snapshot\"\n", 2, "TOML syntax error",
                 id="unclosed-array"),
    pytest.param("[probe]\ninterval_s = 5\n\n[signals.gpu_temprature_c]\ndegraded = 80\n", 4,
                 "unknown signal 'gpu_temprature_c' (did you mean 'gpu_temperature_c'?)",
                 id="unknown-signal"),
    pytest.param("[signals.gpu_temperature_c]\ndegraded = 80\nwarn = 70\n", 3,
                 "unknown key 'warn' in [signals.gpu_temperature_c]", id="unknown-signal-key"),
    pytest.param("[probe]\nintervl_s = 3\n", 2,
                 "unknown key 'intervl_s' in [probe] (did you mean 'interval_s'?)",
                 id="unknown-probe-key"),
    pytest.param("\n\n[alerts]\nemail = \"x@y\"\n", 3, "unknown section [alerts]",
                 id="unknown-section"),
    pytest.param("[signals.gpu_temperature_c]\ndegraded = \"hot\"\n", 2,
                 "degraded threshold must be a number or \"off\", not a string 'hot'",
                 id="threshold-not-a-number"),
    pytest.param("[signals.gpu_temperature_c]\ncritical = true\n", 2,
                 "critical threshold must be a number or \"off\", not a boolean",
                 id="threshold-boolean"),
    pytest.param("[signals.gpu_temperature_c]\ndegraded = nan\n", 2,
                 "degraded threshold must be finite", id="threshold-nan"),
    pytest.param("[probe]\ninterval_s = \"5s\"\n", 2, "interval_s must be a number, not a string",
                 id="interval-not-a-number"),
    pytest.param("[probe]\ninterval_s = 0\n", 2, "interval_s must be > 0", id="interval-zero"),
    pytest.param("[probe]\nstep_window = 2.5\n", 2, "step_window must be an integer, not a float",
                 id="window-float"),
    pytest.param("[probe]\nstep_window = 4\nstep_min_samples = 9\n", 3,
                 "step_min_samples (9) must be <= step_window (4)", id="samples-above-window"),
    pytest.param("[signals.gpu_temperature_c]\ndegraded = 95\ncritical = 85\n", 2,
                 "degraded 95 is above critical 85 for an \"above\" signal",
                 id="degraded-above-critical"),
    pytest.param("[signals.gpu_temperature_c]\ndegraded = 99\n", 2,
                 "degraded 99 is above critical 95 for an \"above\" signal (critical from the "
                 "defaults)", id="degraded-above-default-critical"),
    pytest.param("[signals.disk_free_percent]\ndegraded = 2\ncritical = 5\n", 2,
                 "degraded 2 is below critical 5 for a \"below\" signal",
                 id="below-signal-inverted"),
    pytest.param("[signals]\ngpu_temperature_c = { degraded = 90, critical = 80 }\n", 2,
                 "degraded 90 is above critical 80", id="inline-table-inverted"),
    pytest.param("[signals.gpu_temperature_c]\ndirection = \"over\"\n", 2,
                 "direction must be \"above\" or \"below\", not 'over'", id="bad-direction"),
    pytest.param("[actions]\ncritical = [\"snapshot\", \"page_oncall\"]\n", 2,
                 "unknown action 'page_oncall'", id="unknown-action"),
    pytest.param("[actions]\ndegraded = \"snapshot\"\n", 2,
                 "degraded must be an array of action names", id="action-not-a-list"),
    pytest.param("[actions]\nnonfinite_loss = [\"rollback\", \"snapshot\"]\n", 2,
                 "'snapshot' is not allowed in nonfinite_loss: a non-finite loss never "
                 "snapshots the poisoned state", id="snapshot-on-nan"),
    pytest.param("[actions]\ndegraded = [\"rollback\"]\n", 2,
                 "'rollback' is not allowed in degraded", id="rollback-on-degraded"),
    pytest.param("[actions]\ncritical = [\"snapshot\", \"snapshot\"]\n", 2,
                 "action 'snapshot' is listed twice", id="duplicate-action"),
    pytest.param("[signals.gpu_throttle_reasons]\ndegraded = 1\n", 1,
                 "signal 'gpu_throttle_reasons' is informational", id="info-signal"),
    pytest.param("[signals]\ngpu_temperature_c = 90\n", 2,
                 "signals.gpu_temperature_c must be a table", id="signal-not-a-table"),
    pytest.param("version = 2\n", 1, "unsupported policy version 2", id="version"),
    pytest.param("version = \"1\"\n", 1, "version must be an integer (1), not a string '1'",
                 id="version-string"),
    pytest.param("[probe]\ninterval_s = 1e308\n", 2, "interval_s must be <= 3600, not 1e+308",
                 id="interval-overflows-the-wait"),
    pytest.param("[probe]\ninterval_s = 3601\n", 2, "interval_s must be <= 3600",
                 id="interval-above-an-hour"),
    pytest.param("version = 1\n\nsignals.gpu_temprature_c.degraded = 80\n", 3,
                 "unknown signal 'gpu_temprature_c'", id="unknown-signal-top-level-dotted"),
    pytest.param("[signals]\ngpu_temprature_c.degraded = 80\n", 2,
                 "unknown signal 'gpu_temprature_c'", id="unknown-signal-dotted-in-table"),
    pytest.param("\nprob.interval_s = 5\n", 2, "unknown section [prob]",
                 id="unknown-section-dotted"),
]


@pytest.mark.parametrize(("text", "line", "reason"), MALFORMED)
def test_malformed_policy_is_refused_with_line_and_reason(text: str, line: int,
                                                          reason: str) -> None:
    with pytest.raises(InvalidPolicy) as caught:
        parse_policy(text, source="bad.toml")
    err = caught.value
    assert err.line == line, str(err)
    assert reason in err.reason, err.reason
    assert str(err).startswith(f"bad.toml:{line}")
    assert err.code == "invalid_policy"
    assert isinstance(err, InvalidRequest) and isinstance(err, ValueError)
    assert isinstance(err, CkptdError)
    json.dumps(err.to_json())  # the detail travels as JSON


def test_syntax_error_carries_the_column() -> None:
    with pytest.raises(InvalidPolicy) as caught:
        parse_policy("a = 1\nb = \n")
    assert caught.value.line == 2 and caught.value.detail["column"] == 5
    assert str(caught.value) == "<string>:2:5: TOML syntax error: Invalid value"


def test_every_problem_is_reported_in_line_order() -> None:
    text = (
        "[signals.gpu_temperature_c]\n"  # 1
        "degraded = \"hot\"\n"  # 2
        "\n"
        "[actions]\n"  # 4
        "degraded = [\"snapshot\", \"nap\"]\n"  # 5
        "\n"
        "[probe]\n"  # 7
        "interval = 3\n"  # 8
    )
    with pytest.raises(InvalidPolicy) as caught:
        parse_policy(text, source="p.toml")
    problems = caught.value.detail["problems"]
    assert [p["line"] for p in problems] == [2, 5, 8]
    assert caught.value.line == 2
    assert str(caught.value).splitlines()[1].startswith("p.toml:5: unknown action 'nap'")


def test_the_locator_finds_keys_in_multiline_values_and_quoted_keys() -> None:
    text = (
        '[actions]\n'
        'critical = [\n'
        '  "snapshot",\n'
        '  "bogus",\n'
        ']\n'
        '[signals."gpu_temperature_c"]\n'
        'degraded = "x"\n'
    )
    with pytest.raises(InvalidPolicy) as caught:
        parse_policy(text)
    assert [p["line"] for p in caught.value.detail["problems"]] == [2, 7]


# -- evaluation -------------------------------------------------------------------------


def test_evaluate_ok_when_nothing_crosses() -> None:
    ev = default_policy().evaluate({"gpu_temperature_c[0]": 60, "host_memory_percent": 40.0})
    assert (ev.state, ev.reasons, ev.actions) == ("ok", (), ())


def test_evaluate_reports_the_worst_level_with_reasons() -> None:
    ev = default_policy().evaluate({
        "gpu_temperature_c[0]": 91,
        "gpu_temperature_c[1]": 70,
        "gpu_ecc_uncorrected_volatile[1]": 12,
        "disk_free_percent[/dev/shm]": 4.5,
        "host_memory_percent": "unavailable",
        "gpu_power_w[0]": None,
        "no_such_signal": 1e9,
    })
    assert ev.state == "critical"
    assert ev.reasons == (
        "gpu1 uncorrected ECC errors since driver load 12 >= critical 10",
        "gpu0 temperature 91 C >= degraded 85",
        "disk /dev/shm free 4.5% <= degraded 5",
    )
    assert ev.actions == ("snapshot", "report_failing")
    assert {t.ident for t in ev.triggers["snapshot"]} == {
        "gpu_ecc_uncorrected_volatile[1]:critical",
        "gpu_temperature_c[0]:degraded",
        "disk_free_percent[/dev/shm]:degraded",
    }
    assert [t.ident for t in ev.triggers["report_failing"]] == [
        "gpu_ecc_uncorrected_volatile[1]:critical"
    ]


def test_unavailable_and_non_finite_readings_are_skipped() -> None:
    policy = default_policy()
    signals = dict.fromkeys(GPU_SIGNALS, "unavailable")
    assert policy.evaluate(signals).state == "ok"
    assert policy.evaluate({"gpu_temperature_c[0]": math.inf}).state == "ok"
    assert policy.evaluate({"gpu_temperature_c[0]": math.nan}).state == "ok"


def test_flags_and_named_values_read_well() -> None:
    ev = default_policy().evaluate({
        "gpu_recovery_action[3]": 2,
        "gpu_throttle_hw[3]": 1,
        "gpu_throttle_reasons[3]": "hw_slowdown,sw_power_cap",
    })
    assert ev.reasons == (
        "gpu3 recovery action 2 (node_reboot) >= critical 1",
        "gpu3 hardware clock slowdown (hw_slowdown,sw_power_cap) (degraded)",
    )


def test_a_nonfinite_loss_asks_for_rollback_and_never_a_snapshot() -> None:
    ev = default_policy().evaluate({
        "gpu_ecc_uncorrected_volatile[0]": 20,  # critical: would ask for a snapshot
        "loss": "nan",
        "loss_nonfinite": 1,
        "loss_nonfinite_step": 1234,
    })
    assert ev.state == "critical"
    assert ev.nonfinite and ev.nonfinite_step == 1234
    assert "snapshot" not in ev.actions and "snapshot" not in ev.triggers
    assert ev.actions == ("report_failing", "rollback")
    assert ev.triggers["rollback"][0].ident == "loss_nonfinite:1234"
    assert "loss became non-finite at step 1234 (degraded)" in ev.reasons


def test_nonfinite_loss_acts_even_with_its_thresholds_off() -> None:
    policy = parse_policy('[signals.loss_nonfinite]\ndegraded = "off"\n')
    ev = policy.evaluate({"loss_nonfinite": 1, "loss_nonfinite_step": 7})
    assert ev.state == "ok" and ev.actions == ("rollback",)
    assert ev.reasons == ("loss became non-finite at step 7",)


def test_signal_keys() -> None:
    assert split_signal_key("gpu_temperature_c[0]") == ("gpu_temperature_c", "0")
    assert split_signal_key("disk_free_percent[/a/b]") == ("disk_free_percent", "/a/b")
    assert split_signal_key("host_cpu_percent") == ("host_cpu_percent", None)


# -- the effective policy and the command ------------------------------------------------


def test_effective_toml_round_trips() -> None:
    for policy in (default_policy(), parse_policy(EXAMPLE, source="hot.toml")):
        text = policy.effective_toml()
        assert parse_policy(text) == policy
        for spec in CATALOG:
            assert (f"[signals.{spec.name}]" in text) == (spec.kind != "info")


@settings(max_examples=50, deadline=None)
@given(
    low=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    gap=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    interval=st.floats(min_value=1e-3, max_value=3600, allow_nan=False),
    critical_on=st.booleans(),
)
def test_effective_toml_round_trips_any_thresholds(low: float, gap: float, interval: float,
                                                   critical_on: bool) -> None:
    thresholds = dict(default_policy().thresholds)
    thresholds["server_rtt_ms"] = SignalThreshold("above", low, low + gap if critical_on else None)
    thresholds["disk_free_gib"] = SignalThreshold("below", low + gap, low)
    policy = Policy(thresholds=thresholds, probe=ProbeSettings(interval_s=interval))
    assert parse_policy(policy.effective_toml()) == policy


def test_check_command_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(EXAMPLE)
    code, text = check_command(str(good))
    assert code == 0
    assert parse_policy(text) == parse_policy(EXAMPLE)
    assert "degraded = 88" in text and str(good) in text

    bad = tmp_path / "bad.toml"
    bad.write_text("[signals.gpu_temperature_c]\ndegraded = 95\ncritical = 85\n")
    code, text = check_command(str(bad))
    assert code == 1
    assert text.startswith(f"{bad}:2: degraded 95 is above critical 85")

    code, text = check_command(str(tmp_path / "missing.toml"))
    assert code == 2 and "cannot read policy file" in text


def test_every_catalog_signal_is_documented_with_its_defaults() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "policy.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].startswith("`") and cells[0].strip("`") in SIGNALS:
            rows[cells[0].strip("`")] = cells[1:6]

    def shown(value: float | None) -> str:
        return "off" if value is None else f"{value:g}"

    assert set(rows) == set(SIGNALS)
    for spec in CATALOG:
        kind, _unit, direction, degraded, critical = rows[spec.name]
        assert kind == spec.kind, spec.name
        if spec.kind != "info":
            assert (direction, degraded, critical) == (
                spec.direction, shown(spec.degraded), shown(spec.critical)), spec.name
