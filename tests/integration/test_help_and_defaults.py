"""Help and defaults as a new user meets them: serve's defaults shown, no <bool>
placeholders, command summaries whole at 80 columns, status tables within 80
columns with every reason, ``status --watch`` ending its line, /docs offline."""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from rich.console import Console

from ckptd.cli import SERVE_DEFAULTS
from ckptd.cli.status import status_view
from tests.cli_runs import ckptd as run_ckptd

if TYPE_CHECKING:
    from pathlib import Path

    from tests.conftest import ServerProcess


def ckptd(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env.update(COLUMNS=str(columns), NO_COLOR="1")
    return run_ckptd(*args, environ=env)


def test_serve_help_shows_the_defaults_the_server_uses() -> None:
    from ckptd.server.settings import Settings

    defaults = Settings.model_fields
    assert {"store": defaults["store"].default,
                              "host": defaults["host"].default,
                              "port": str(defaults["port"].default)} == SERVE_DEFAULTS
    text = " ".join(ckptd("serve", "--help").stdout.split())
    for value in SERVE_DEFAULTS.values():
        assert f"[default: {value}]" in text, text


COMMANDS = ["serve", "ls", "verify", "status", "rollback", "restore", "demo", "policy",
            "policy check"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_no_bool_placeholder_and_fits_80_columns(command: str) -> None:
    done = ckptd(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert "<bool>" not in done.stdout, done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 80, done.stdout


def test_command_summaries_are_whole_sentences() -> None:
    from typer.main import get_command

    from ckptd.cli import app

    listing = " ".join(ckptd("--help").stdout.split("Commands:", 1)[1].split())
    assert "..." not in listing and "…" not in listing, listing
    for name, command in get_command(app).commands.items():  # type: ignore[attr-defined]
        summary = " ".join((command.help or "").split("\n\n")[0].split())
        first = re.split(r"(?<=\.)\s", summary)[0]
        assert f"{name} {first}" in listing, (name, first, listing)


def _overview() -> dict[str, Any]:
    signals = {"gpu_temperature_c[0]": 91.0, "gpu_ecc_uncorrected_volatile[0]": 2,
               "host_memory_percent": 72.4}

    def rank(i: int, state: str, reasons: list[str]) -> dict[str, Any]:
        return {"rank": i, "state": state, "step": 1234567, "held_step": 1234500,
                "age_s": 12.5, "rtt_ms": 120.25,
                "health": {"state": "ok", "reasons": reasons, "signals": signals}}

    reasons = ["GPU temperature 91 °C is over the 85 °C limit for 3 probes in a row",
               "host memory 95 % is over 90 %", "uncorrected ECC errors on GPU 0: 2"]
    return {"jobs": [{
        "job": "llm-7b-pretrain", "world_size": 4, "latest": 1234500, "snapshot_at": 1234600,
        "snapshot_reason": "gpu 0 ECC errors", "rollback_to": None,
        "ranks": [rank(0, "alive", []), rank(1, "degraded", reasons), rank(2, "critical", []),
                  rank(3, "dead", [])],
        "events": [],
    }]}, reasons


@pytest.mark.parametrize("width", [80, 100])
def test_status_table_fits_the_terminal_and_keeps_every_reason(width: int) -> None:
    overview, reasons = _overview()
    console = Console(width=width, record=True, color_system=None)
    console.print(status_view(overview, width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width, text
    flat = " ".join(text.split())
    for reason in reasons:
        assert reason in flat, (reason, text)
    assert "…" not in text, text
    for rank, state in enumerate(("alive", "degraded", "critical", "dead")):
        assert re.search(rf"^\s*{rank}\s+{state}\s", text, re.M), text


def test_status_watch_ends_with_a_newline(server: ServerProcess) -> None:
    done = ckptd("status", "--url", server.url, "--watch", "0.3", "--every", "0.1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n"), repr(done.stdout[-40:])


def test_status_watch_into_a_pipe_writes_each_refresh_as_it_comes(server: ServerProcess
                                                                   ) -> None:
    """(Found by a probe of the docs.) Into a pipe or a log, a watch wrote nothing
    until it ended, then one frame: ``kubectl logs`` of a watch showed nothing."""
    done = ckptd("status", "--url", server.url, "--watch", "1.2", "--every", "0.4")
    assert done.returncode == 0, done.stderr
    frames = done.stdout.count("no jobs")
    assert frames >= 3 and done.stdout.count(" UTC\n") == frames, done.stdout


def test_docs_work_offline_pointing_to_the_api_reference(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/docs", timeout=5)
    assert r.status_code == 200
    assert "docs/API.md" in r.text and "/openapi.json" in r.text
    assert "cdn" not in r.text.lower().replace("a cdn", "")  # loads nothing from outside
    assert httpx.get(f"{server.url}/openapi.json", timeout=5).status_code == 200
    started = time.monotonic()
    assert httpx.get(f"{server.url}/redoc", timeout=5).status_code in (401, 404)
    assert time.monotonic() - started < 5


def _url_helps() -> dict[str, str]:
    """Each command's ``--url`` help, by the command's name."""
    from typer.main import get_command

    from ckptd.cli import app

    found: dict[str, str] = {}

    def walk(command: Any, name: str) -> None:
        for sub, child in getattr(command, "commands", {}).items():  # (a group's)
            walk(child, f"{name} {sub}".strip())
        for param in command.params:
            if "--url" in getattr(param, "opts", ()):
                found[name] = " ".join(str(getattr(param, "help", "")).split())

    walk(get_command(app), "")
    return found


def test_every_url_help_names_the_urls_its_command_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(found by a probe: --url said http:// or file:// only, where most commands
    read an s3:// store as well; status and rollback take a server only.) Each
    command is run on an s3:// and a file:// URL: its help names the schemes it
    does not refuse."""
    import torch
    from typer.testing import CliRunner

    from ckptd.cli import app

    torch.save({"w": torch.zeros(2)}, tmp_path / "src.pt")
    # Arguments that take each command as far as its URL.
    reach = {
        "ls": [], "verify": ["j"], "rollback": ["j", "1"], "status": [],
        "restore": ["--job", "j", "--rank", "0", "--to", str(tmp_path / "to")],
        "forget": ["j", "--keep-last", "1"], "gc": ["--dry-run", "--grace", "0"],
        "scrub": [], "tag": ["j", "1", "t"], "untag": ["j", "t"], "space": [],
        "export": ["j", "--zarr", str(tmp_path / "z")],
        "import": [str(tmp_path / "src.pt"), "--job", "j", "--step", "1"],
        "diff": ["j", "1", "2"],
    }
    helps = _url_helps()
    assert set(helps) == set(reach), "a command with --url to probe here"
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                        "AWS_DEFAULT_REGION": "us-east-1", "CKPTD_RETRIES": "0"}.items():
        monkeypatch.setenv(name, value)
    urls = {"s3://": "s3://ckptd-none/p?endpoint=http://127.0.0.1:9",  # (nothing listens)
            "file://": f"file://{tmp_path / 'store'}"}
    for name, args in reach.items():
        for scheme, url in urls.items():
            out = " ".join(CliRunner().invoke(app, [name, *args, "--url", url]).output.split())
            refused = "needs a server" in out or "unsupported URL" in out
            assert (scheme in helps[name]) == (not refused), (name, scheme, helps[name], out)
