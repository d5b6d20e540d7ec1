"""The README's set-up commands show their progress, and CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    try_it = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(python3 -m venv .+)\n```", try_it)


def test_the_two_setup_commands_show_what_they_install() -> None:
    commands = setup_commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert not re.search(r"\s-q\b|--quiet", command), command


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = next(c for c in setup_commands() if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()
