"""``ckptd ls JOB`` tells a step still waiting for ranks (pending) from one every
rank saved that did not commit: its commit was refused (a shape or tiling the
ranks disagree on) or is under way, and it stays until the job's retention
abandons it. A probe read the second as "pending" for ever. It names each step's
tags (retention keeps them; a probe found no command that listed them)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.repository import Repository
from ckptd.store.local import LocalStore
from ckptd.testing.manifests import demo_step, put_rank

pytestmark = pytest.mark.timeout(120)

JOB = "j"


async def _fill(root: Path) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    try:
        for manifest, chunks in demo_step(JOB, 1, 2):  # committed
            await put_rank(repo, manifest, chunks)
        await repo.commit(JOB, 1)
        await repo.tag(JOB, "best", 1)
        await repo.tag(JOB, "warm-up", 1)
        for manifest, chunks in demo_step(JOB, 2, 2):  # both ranks, no commit
            await put_rank(repo, manifest, chunks)
        manifest, chunks = demo_step(JOB, 3, 2)[0]  # rank 0 only
        await put_rank(repo, manifest, chunks)
    finally:
        await repo.store.close()


def test_a_step_every_rank_saved_without_a_commit_is_not_called_pending(tmp_path: Path) -> None:
    root = tmp_path / "store"
    asyncio.run(_fill(root))
    done = subprocess.run([sys.executable, "-m", "ckptd", "ls", JOB, "--url", f"file://{root}"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines()
            if line[:1] == "│" and line.split()[1].isdigit()}
    assert "committed" in rows["1"] and "not" not in rows["1"], done.stdout
    assert "latest, tag best, tag warm-up" in rows["1"], done.stdout
    assert "tag" not in rows["2"] + rows["3"], done.stdout
    assert "not committed" in rows["2"] and "2/2" in rows["2"], done.stdout
    assert "pending" in rows["3"] and "1/2" in rows["3"], done.stdout
    (note,) = [line for line in done.stderr.splitlines() if "not committed" in line]
    assert "step 2:" in note and "refused" in note and "abandon_pending_after" in note, note


def test_a_store_without_jobs_says_so_rather_than_an_empty_table(tmp_path: Path) -> None:
    asyncio.run(Repository(LocalStore(tmp_path / "store", fsync=False)).store.close())
    (tmp_path / "store").mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--url",
                           f"file://{tmp_path / 'store'}"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no jobs in file://") and "a save creates" in done.stdout
    assert "┏" not in done.stdout, done.stdout


async def _commit(root: Path, step: int) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    try:
        for manifest, chunks in demo_step(JOB, step, 2):
            await put_rank(repo, manifest, chunks)
        await repo.commit(JOB, step)
    finally:
        await repo.store.close()


def _ls(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", "ls", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def test_damage_a_listing_can_see_is_damage_and_exit_1(tmp_path: Path) -> None:
    """(Found by an operator probe, each listed with exit 0: a committed step, not
    latest, whose rank manifest is gone, "committed 1/2"; a latest ref naming a step
    the store does not hold, "9 (damaged)" over the jobs and no word in the steps.)"""
    root = tmp_path / "store"
    asyncio.run(_fill(root))
    asyncio.run(_commit(root, 4))  # (step 1 is no longer latest: its manifests go unread)
    (root / "jobs" / JOB / "steps" / "1" / "ranks" / "1.json").unlink()
    url = f"file://{root}"
    done = _ls(JOB, "--url", url)
    assert done.returncode == 1, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("│ 1 "))
    assert "damaged" in row and "1/2" in row, done.stdout
    said = " ".join(done.stderr.split())
    assert "1 of the 2 rank manifests its commit record names is missing" in said, said

    root = tmp_path / "store2"
    asyncio.run(_fill(root))
    ref = root / "jobs" / JOB / "refs" / "latest"
    ref.write_bytes(ref.read_bytes().replace(b'"step":1', b'"step":9'))
    url = f"file://{root}"
    for args in ([], [JOB]):
        done = _ls(*args, "--url", url)
        said = " ".join(done.stderr.split())
        assert done.returncode == 1, done.stdout + done.stderr
        assert "latest: it names step 9, which the store does not hold; a restore of " \
            "latest gets 1" in said, said
    assert "1 (9 damaged)" in _ls("--url", url).stdout
