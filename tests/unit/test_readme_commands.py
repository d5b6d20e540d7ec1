"""The README gets a person to success in one screen: its two set-up commands come
first and show their progress, CI runs its test command, the quick start is short,
every page it links to exists, and the reference it used to hold lives on in docs/.
The test command's browser tests say how to get chromium, and fail in CI without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

def setup_commands() -> list[str]:
    readme = README.read_text()
    try_it = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(python3 -m venv .+)\n```", try_it)


def sections() -> list[str]:
    return re.findall(r"^## (.+)$", README.read_text(), re.M)


def test_the_two_setup_commands_show_what_they_install() -> None:
    commands = setup_commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert not re.search(r"\s-q\b|--quiet", command), command


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = next(c for c in setup_commands() if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_the_readme_is_a_quick_start_then_links() -> None:
    assert sections()[:5] == ["Try it", "Quick start", "Use it in a training loop",
                              "Several nodes", "Reference"], sections()
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 100, len(lines)
    start = lines.index("## Quick start")
    end = lines.index("## Several nodes")
    assert end - start <= 50, end - start  # install, serve, the loop, torchrun: a screen
    quick = "\n".join(lines[start:end])
    assert "ckptd serve" in quick and "torchrun" in quick and "restore" in quick
    # The loop takes rank and world size from torchrun, not from the user.
    assert 'Checkpointer(job="' in quick and "rank=" not in quick
    several = text.split("## Several nodes", 1)[1].split("\n## ", 1)[0]
    assert "(docs/multinode.md)" in several


def _links(page: Path) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
            if not m.startswith(("http://", "https://"))]


def test_every_page_the_readme_and_docs_link_to_exists() -> None:
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        for link in _links(page):
            target = (page.parent / link).resolve()
            assert target.exists(), f"{page.relative_to(REPO)} links to {link}, not there"
    linked = {(README.parent / link).resolve().relative_to(REPO).as_posix()
              for link in _links(README)}
    for page in ("client", "failover", "dcp", "operations", "replicas", "SECURITY",
                 "retention", "zarr", "FORMAT", "API", "development", "multinode"):
        assert f"docs/{page}.md" in linked, page


# What the README said before it became a quick start: each still said somewhere.
KEPT = [
    # the training loop
    "RNGState", "ModelState(model, optimizer)", "strict=False", "RestoreError",
    "ReplicaMismatch", "ckptd_snapshot_failures_total", 'on_error="raise"',
    "default_placement", "Shard(global_shape, offsets)", "local=[...]", "staging_budget=",
    "block_training=False", "handle.staged()", 'on_busy="wait" | "skip"', "handle.wait()",
    "file:///path", "e.rollback_to", "--max-restarts",
    # failover and health
    "cache_dir=", "RestoreResult.problems", "RestoreResult.bytes_from",
    "ckptd.client.distributed.init_process_group", "CKPTD_INCARNATION", "incarnation=",
    "superseded", "docs/policy.md", "coordinated snapshot",
    # DCP
    "ckptd+http://host:port/JOB/STEP", "ckptd+file:///dir/JOB/STEP", "CheckpointException",
    "ckptd.client.dcp.ckptd_error(exc)", "weights_only=True", "UnsupportedValue",
    'AssertionError("metadata is None; ...")',
    # operations
    "ckptd verify JOB [STEP]", "ckptd status JOB --watch 0", "ckptd rollback JOB --clear",
    "ckptd restore --job JOB --rank R --to DIR", "ckptd policy check policy.toml",
    "CKPTD_METRICS_TOKEN_REQUIRED", "/openapi.json", "--gc-interval 3600",
    "ckptd forget JOB --keep-last 5 --dry-run", "ckptd scrub", "ckptd tag JOB STEP eval-best",
    "ckptd space", "POST /v1/gc/runs", "CKPTD_MIN_FREE_BYTES", "store_full",
    "ckptd token create --job 'llm-*' --role write --file tokens", "--tokens-file tokens",
    "--tls-cert /etc/ckptd/cert.pem", "CKPTD_CA_BUNDLE", "open_transport(url, ca_bundle=...)",
    "docker build -t", "tests/integration/test_install.py",
    # replicas, zarr, layout
    "--member-leases", "GET /v1/cluster", "rendezvous hashing", "local-cluster.sh",
    "CheckpointStore", "ckptd export llm 1200", "ckptd diff llm 1100 1200 --values",
    "ckptd.dtype", "client/calls.py", "pip install -e .", "bench/RESULTS.md",
]


def test_the_reference_moved_to_docs_and_nothing_was_lost() -> None:
    said = " ".join(" ".join(p.read_text().split()) for p in
                    [README, *sorted((REPO / "docs").glob("*.md"))])
    missing = [phrase for phrase in KEPT if phrase not in said]
    assert not missing, missing


def test_the_test_command_installs_the_browser_tests_package() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    assert any(e.startswith("playwright") for e in extras)
    try_it = README.read_text().split("## Try it", 1)[1].split("\n## ", 1)[0]
    assert "apt-get install chromium" in try_it
    assert "apt-get install -y -qq chromium" in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_chromium_the_browser_tests_say_how_to_get_it_and_fail_in_ci(ci: str) -> None:
    pytest.importorskip("playwright.sync_api")
    env = {**os.environ, "CKPTD_TEST_CHROMIUM": "/nonexistent/chromium", "CI": ci}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(REPO / "tests" / "browser")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "sudo apt-get install chromium" in out, out
    # (every browser test: none passed, none failed for its own reasons)
    assert " passed" not in out and " failed" not in out, out
    if ci:
        assert done.returncode != 0 and re.search(r"\b\d+ errors?\b", out), out
    else:
        assert done.returncode == 0 and re.search(r"\b\d+ skipped\b", out), out
