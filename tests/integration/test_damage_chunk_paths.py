"""A chunk path of a directory store that holds a FIFO (an operator probe's kind of
damage): verify and scrub name the chunk and what it breaks, exit 1, and go on.
Before, each blocked for good on the FIFO's open."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_runs import ckptd as run_ckptd
from tests.integration.test_damage_documents import golden

pytestmark = pytest.mark.timeout(120)


def ckptd(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_ckptd(*args, "--url", f"file://{root}", environ=dict(os.environ), timeout=30)


def test_a_fifo_chunk_is_named_by_verify_and_scrub(tmp_path: Path) -> None:
    root = golden(tmp_path)
    manifest = json.loads((root / "jobs/golden/steps/1/ranks/0.json").read_bytes())
    cid = manifest["entries"][0]["chunks"][0]
    path = root / "chunks" / cid[:2] / cid
    path.unlink()
    os.mkfifo(path)
    try:
        verified = ckptd(root, "verify", "golden")
        scrubbed = ckptd(root, "scrub")
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{exc.cmd[3]} blocked on a FIFO chunk")
    said = " ".join((verified.stdout + verified.stderr).split())
    assert verified.returncode == 1 and f"unreadable chunk {cid}: breaks step 1" in said, said
    said = " ".join((scrubbed.stdout + scrubbed.stderr).split())
    assert scrubbed.returncode == 1 and f"unreadable {cid}" in said, said
    assert "damaged golden steps [1, 2]" in said and "Traceback" not in said, said


async def test_scrub_tells_a_chunk_that_does_not_read_from_a_corrupt_one(
        tmp_path: Path) -> None:
    """verify calls a chunk whose object does not read (a link that loops) unreadable;
    scrub's report called it corrupt only, as it does a chunk of wrong bytes."""
    from ckptd.lifecycle.scrub import scrub
    from ckptd.repository import Repository
    from ckptd.store import LocalStore

    root = golden(tmp_path)
    manifest = json.loads((root / "jobs/golden/steps/1/ranks/0.json").read_bytes())
    looped, wrong = manifest["entries"][0]["chunks"][0], manifest["entries"][1]["chunks"][0]
    path = root / "chunks" / looped[:2] / looped
    path.unlink()
    path.symlink_to(path.name)
    path = root / "chunks" / wrong[:2] / wrong
    path.chmod(0o644)
    path.write_bytes(b"\xff" + path.read_bytes()[1:])
    store = LocalStore(root)
    try:
        report = await scrub(Repository(store))
    finally:
        await store.close()
    assert sorted(report.corrupt) == sorted([looped, wrong])
    assert report.unreadable == [looped]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_restore_meets_a_chunk_path_that_is_no_file_as_damage(tmp_path: Path,
                                                                kind: str) -> None:
    """(Found by an operator probe: a directory at a chunk's path was exit 2 and
    "store: IsADirectoryError", a usage mistake's code; a FIFO hung the restore.)"""
    root = golden(tmp_path)
    manifest = json.loads((root / "jobs/golden/steps/2/ranks/0.json").read_bytes())
    cid = manifest["entries"][0]["chunks"][0]
    path = root / "chunks" / cid[:2] / cid
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    try:
        done = ckptd(root, "restore", "--job", "golden", "--rank", "0", "--step", "2",
                     "--to", str(tmp_path / "to"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the restore blocked on a {kind} at a chunk's path")
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1 and cid[:12] in said, said
    assert "Traceback" not in said and "IsADirectoryError" not in said, said
