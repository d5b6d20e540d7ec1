"""``CKPTD_SCRUB_REPLICA`` is checked with the other settings: ``ckptd serve
--check`` and ``ckptd serve`` refuse a wrong one in a line naming the variable
(exit 2), and a replica is never created. Found by a probe: ``serve --check`` said
"ok: would serve" of ``ftp://x``, then ``serve`` died with a 79-line traceback from
its lifespan (exit 3); a mistyped path was made an empty directory that scrub
then "repaired" from. (A good replica, repaired from: test_scrub_damage_heals.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.test_cli_mistakes import assert_short_usage_error, ckptd

pytestmark = pytest.mark.timeout(180)


def _serve(tmp_path: Path, replica: str, *check: str) -> subprocess.CompletedProcess[str]:
    """``ckptd serve`` (``--check``) over a new store in ``tmp_path``, run from there."""
    try:
        return ckptd("serve", "--store", str(tmp_path / "store"), "--port", "0", *check,
                     env={"CKPTD_SCRUB_REPLICA": replica}, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ckptd serve {' '.join(check)} with CKPTD_SCRUB_REPLICA="
                             f"{replica} served instead of refusing it") from None


@pytest.mark.parametrize("check", [["--check"], []], ids=["check", "serve"])
@pytest.mark.parametrize("replica, says", [
    ("ftp://x", "unsupported store URL"),
    ("./no-such-replica", "no such directory"),
    ("http://127.0.0.1:1", "is a server"),
    ("memory://", "new, empty store"),
])
def test_serve_refuses_a_scrub_replica_that_is_no_store_in_one_line(
    tmp_path: Path, check: list[str], replica: str, says: str
) -> None:
    done = _serve(tmp_path, replica, *check)
    assert_short_usage_error(done, "CKPTD_SCRUB_REPLICA", replica, says)
    assert not (tmp_path / "no-such-replica").exists()  # never created
    assert "would serve" not in done.stdout, done.stdout


def test_serve_check_accepts_a_scrub_replica_directory(tmp_path: Path) -> None:
    (tmp_path / "replica").mkdir()
    done = _serve(tmp_path, "./replica", "--check")
    assert done.returncode == 0 and "ok: would serve" in done.stdout, done.stdout + done.stderr
