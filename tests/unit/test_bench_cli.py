"""The benchmark scripts as a user meets them: ``--help`` says what each does in whole
sentences, a machine without CUDA gets one line and a non-zero exit where nothing
can be measured (or the CPU where it can), a meaningless request is refused in one
line, reports name the command as run, the bench's own second staging pools say
nothing, and no script sends a reader to a file a clone of this repository lacks."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if "\ndef main(" in p.read_text())


class _Parsed(Exception):
    """Raised instead of parsing: the parser a script's main() built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(script: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The argument parser ``bench.<script>``'s main() builds, caught before it parses."""

    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(sys, "argv", [f"bench.{script}"])
    module = importlib.import_module(f"bench.{script}")
    with pytest.raises(_Parsed) as got:
        module.main()
    return got.value.parser


def run_bench(*args: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m bench.<...>`` as a user on a machine without CUDA runs it."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CKPTD_SHM_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_the_scripts_are_found() -> None:
    assert {"gc", "gpu", "profile_restore", "restore", "failover", "soak"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_the_script_in_whole_sentences(
        script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    description = (parser_of(script, monkeypatch).description or "").strip()
    assert len(description) > 30, (script, description)
    assert description.endswith((".", ".)")), (script, description)


@pytest.mark.parametrize("script", ["gc", "gpu", "profile_restore"])
def test_every_option_says_what_it_does(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = parser_of(script, monkeypatch)
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not bare, (script, bare)


def test_no_script_cites_a_file_outside_the_repository() -> None:
    for path in [*BENCH.glob("*.py"), *BENCH.glob("*.sh")]:
        text = path.read_text()
        assert "/work/" not in text, path
        if path.suffix == ".py":  # the targets are stated where they are cited
            assert "DESIGN.md" not in text, path
    intro = (BENCH / "RESULTS.md").read_text().split("## How to run")[0]
    assert "/work/" not in intro


def test_bench_gpu_without_cuda_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    done = run_bench("bench.gpu", "--size", "1M", tmp_path=tmp_path)
    assert done.returncode == 1, done
    assert done.stdout == ""
    assert re.fullmatch(r"bench\.gpu: no CUDA device here; [^\n]*--device cpu[^\n]*\n",
                        done.stderr), done.stderr


@pytest.mark.slow
def test_profile_restore_without_cuda_profiles_the_cpu_quietly(tmp_path: Path) -> None:
    done = run_bench("bench.profile_restore", "--size", "4M", "--rounds", "1",
                     tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "restore seconds (on cpu):" in done.stdout
    # The bench's reader beside its saver is a second pool of this process, on purpose.
    assert "Traceback" not in done.stderr and "another pool" not in done.stderr, done.stderr


def test_profile_restore_asked_for_cuda_without_it_says_so_in_one_line(tmp_path: Path) -> None:
    done = run_bench("bench.profile_restore", "--device", "cuda", "--size", "1M",
                     tmp_path=tmp_path)
    assert done.returncode == 1, done
    assert re.fullmatch(r"bench\.profile_restore: no CUDA device here; [^\n]*--device cpu"
                        r"[^\n]*\n", done.stderr), done.stderr


def test_gc_with_nothing_to_forget_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run_bench("bench.gc", "--size", "1M", "--steps", "10", tmp_path=tmp_path)
    assert done.returncode == 1, done
    assert done.stdout == ""
    assert re.fullmatch(r"bench\.gc: --steps 10 leaves nothing to collect [^\n]*more than 10\n",
                        done.stderr), done.stderr


@pytest.mark.slow
def test_gc_labels_its_table_with_the_steps_it_forgot(tmp_path: Path) -> None:
    done = run_bench("bench.gc", "--size", "1M", "--steps", "12", "--rounds", "1",
                     "--saves", "1", "--dir", str(tmp_path), tmp_path=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "| GC of 2 forgotten steps | value |" in done.stdout, done.stdout


def test_failover_heading_records_the_whole_command() -> None:
    from bench.failover import command

    argv = ["--rounds", "1", "--settings", "torch defaults,docs/multinode.md", "--width", "64"]
    assert command(argv) == ("python -m bench.failover --rounds 1 --settings "
                             "'torch defaults,docs/multinode.md' --width 64")


def test_failover_names_the_settings_it_knows_for_one_it_does_not(tmp_path: Path) -> None:
    done = run_bench("bench.failover", "--settings", "torch default", tmp_path=tmp_path,
                     timeout=60)
    assert done.returncode == 1, done
    assert re.fullmatch(r"bench\.failover: no torchrun setting 'torch default'; [^\n]*"
                        r"torch defaults, [^\n]*\n", done.stderr), done.stderr


def test_soak_default_output_stays_out_of_git(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = parser_of("soak", monkeypatch).get_default("out")
    for where in (REPO, REPO / "bench"):  # run from the root, or from a folder in it
        checked = subprocess.run(["git", "check-ignore", "-q", f"{out}/soak.csv"], cwd=where,
                                 timeout=30)
        assert checked.returncode == 0, (where, out)
