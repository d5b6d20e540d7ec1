"""A damaged timeline (``jobs/<job>/refs/timeline``) no longer says which committed
steps a rollback left behind. A restore of latest must never hand back one of them
(an operator probe: after ``ckptd rollback golden 1`` and ``echo xx > .../timeline``,
``ckptd restore``, a server's ``GET latest`` and ``ckptd ls`` all gave step 2, the
step rolled back from). While the rollback marker is set its step is latest; without
one no step is, and the answer is ``store_corrupt`` naming the timeline."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from ckptd.cli import app
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)

GOLDEN = Path(__file__).parents[1] / "data" / "golden-v1"
TIMELINE = "jobs/golden/refs/timeline"


def cli(root: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--url", f"file://{root}"])
    return result.exit_code, " ".join(result.output.split())


def row(table: str, step: int) -> str:
    """Step ``step``'s row of ``ckptd ls JOB``'s table (its output on one line)."""
    return table.split(f"│ {step} │", 1)[1].split(f"│ {step + 1} │", 1)[0]


def life(tmp_path: Path) -> Path:
    """The golden store after a tag, a scrub, a collection and a rollback to step 1
    (steps 1 and 2 committed, 3 pending): the probe's "life" store."""
    root = tmp_path / "life"
    shutil.copytree(GOLDEN, root)
    for args in (["tag", "golden", "1", "best"], ["scrub"], ["gc", "--grace", "0"],
                 ["rollback", "golden", "1", "--reason", "test"]):
        code, out = cli(root, *args)
        assert code == 0, (args, out)
    return root


def test_a_damaged_timeline_with_its_marker_restores_the_markers_step(
        tmp_path: Path) -> None:
    root = life(tmp_path)
    (root / TIMELINE).write_bytes(b"xx\n")
    code, out = cli(root, "restore", "--job", "golden", "--rank", "0", "--to",
                    str(tmp_path / "to"))
    assert code == 0 and "step 1 of golden" in out, out  # was: step 2, rc 0
    code, out = cli(root, "ls", "golden")
    assert "latest" in row(out, 1) and "latest" not in row(out, 2), out
    srv = ServerProcess(store=root)
    srv.start()
    try:
        got = httpx.get(f"{srv.url}/v1/jobs/golden/latest", timeout=30)
        assert got.status_code == 200 and got.json()["step"] == 1, got.text
    finally:
        srv.stop()


def test_a_damaged_timeline_without_a_marker_chooses_no_step(tmp_path: Path) -> None:
    """The marker cleared (by hand, or by a commit past it): which steps were left
    behind cannot be told, so a restore of latest refuses, naming the timeline; a
    restore that names its step still works."""
    root = life(tmp_path)
    (root / TIMELINE).write_bytes(b"xx\n")
    (root / "jobs/golden/refs/rollback").unlink()
    code, out = cli(root, "restore", "--job", "golden", "--rank", "0", "--to",
                    str(tmp_path / "to"))
    assert code == 1 and "[store_corrupt]" in out and TIMELINE in out, out
    assert "ckptd rollback golden STEP" in out, out
    code, out = cli(root, "restore", "--job", "golden", "--rank", "0", "--step", "1",
                    "--to", str(tmp_path / "one"))
    assert code == 0 and "step 1 of golden" in out, out
    srv = ServerProcess(store=root)
    srv.start()
    try:
        got = httpx.get(f"{srv.url}/v1/jobs/golden/latest", timeout=30)
        assert got.status_code == 500, got.text
        assert got.json()["code"] == "store_corrupt", got.text
        assert TIMELINE in got.text
    finally:
        srv.stop()
