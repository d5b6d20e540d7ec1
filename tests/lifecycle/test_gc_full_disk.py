"""A store whose disk is full to the last byte can still be made room in with
ckptd's own tools (an operator's probe: on a 20 MiB tmpfs filled by dd, `ckptd
forget` failed writing its removal claim and `ckptd gc` updating gc/state, both
`store_full`, whose own advice was to run them). A collection leaves a space
reserve in the store that a full disk's lifecycle write releases; with no reserve
left, the message says what an operator may delete by hand."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.lifecycle.reserve import RESERVE_NAME
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank

REPO = Path(__file__).resolve().parents[2]
JOB = "f"


@contextlib.contextmanager
def small_disk(where: Path, size: str = "20m") -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where`` (root only: CI runs as root)."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, env={**env, "COLUMNS": "200"}, cwd=REPO, timeout=60)


def _fill(disk: Path) -> Path:
    """Fills the disk to its last byte (as `dd if=/dev/zero of=...` does)."""
    filler = disk / "filler"
    block = bytes(64 << 10)
    with open(filler, "wb", buffering=0) as f:
        for piece in (block, bytes(512)):
            with contextlib.suppress(OSError):
                while f.write(piece):
                    pass
    assert shutil.disk_usage(disk).free < 4096
    return filler


async def _steps(root: Path, n: int) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    for step in range(n):
        for manifest, chunks in demo_step(JOB, step, 1, rows=512, seed=str(step)):
            await put_rank(repo, manifest, chunks)
        assert (await repo.commit(JOB, step)).state == "committed"
    await repo.close()


def test_forget_and_gc_run_on_a_disk_filled_to_the_last_byte(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        root = disk / "store"
        asyncio.run(_steps(root, 6))
        # No reserve yet (no server started, no collection ran): what to do by hand.
        filler = _fill(disk)
        refused = _ckptd("forget", JOB, "--keep-last", "1", "--url", str(root))
        assert refused.returncode != 0
        said = " ".join(refused.stderr.split())
        assert "No space left on device" in said and "space reserve is used up" in said, said
        assert "`.tmp-*` files older than an hour" in said and "never a file under chunks/" in said
        assert "Traceback" not in refused.stderr
        # A collection with room makes the reserve; the disk fills again.
        filler.unlink()
        made = _ckptd("gc", "--grace", "0", "--url", str(root))
        assert made.returncode == 0, made.stderr
        assert (root / ".locks" / RESERVE_NAME).is_file()
        _fill(disk)
        forgot = _ckptd("forget", JOB, "--keep-last", "1", "--url", str(root))
        assert forgot.returncode == 0, forgot.stderr
        assert "forgot 5 steps" in forgot.stdout
        freed = _ckptd("gc", "--grace", "0", "--url", str(root))
        assert freed.returncode == 0, freed.stderr
        assert "GC 2: freed" in freed.stdout and "GC 2: freed 0 B" not in freed.stdout
        assert _ckptd("verify", JOB, "--url", str(root)).returncode == 0
        # Full again, the reserve made again by that collection: gc alone runs too
        # (it failed updating gc/state).
        assert (root / ".locks" / RESERVE_NAME).is_file()
        _fill(disk)
        again = _ckptd("gc", "--grace", "0", "--url", str(root))
        assert again.returncode == 0, again.stderr
        assert "GC 3: freed 0 B" in again.stdout
