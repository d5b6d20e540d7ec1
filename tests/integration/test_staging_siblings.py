"""Removing a stale pool never removes the pool of a live process that claimed the
same directory meanwhile (two processes: this one removes, a child claims)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptd.client.staging import reader
from ckptd.client.staging.reader import remove_stale_pools
from ckptd.client.staging.segments import _open_control, pool_dir

pytestmark = pytest.mark.timeout(60)

# Claims the pool directory the way StagingPool._claim does (make it, lock its
# control file, again while it vanishes), reports, then holds it until asked
# whether the directory and its control file are still its own.
CLAIMER = """
    import os, sys, time
    from pathlib import Path
    from ckptd.client.staging.format import CONTROL_NAME
    from ckptd.client.staging.segments import _open_control

    d = Path(sys.argv[1])
    deadline = time.monotonic() + 20
    opened = None
    while opened is None and time.monotonic() < deadline:
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            opened = _open_control(d, lock=True)
        except FileNotFoundError:
            continue
        if opened is None:
            time.sleep(0.001)
    print("locked" if opened else "never", flush=True)
    sys.stdin.readline()
    fd = opened[0]
    try:
        mine = os.stat(d / CONTROL_NAME).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        mine = False
    print("intact" if mine else "destroyed", flush=True)
"""


def test_a_stale_pool_removed_while_a_live_process_claims_its_name_keeps_the_new_pool(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = pool_dir("j", 0, shm).with_name("rank-0.4242-abcdef")  # its owner died
    stale.mkdir(parents=True)
    opened = _open_control(stale, lock=True)
    assert opened is not None
    opened[1].close()
    os.close(opened[0])  # the lock dies with its owner
    (stale / "seg-dead-0").write_bytes(b"x" * 4096)

    real = reader._remove_pool_files
    claimers: list[subprocess.Popen[str]] = []

    def remove_pool_files(directory: Path) -> None:
        real(directory)  # the stale control file is unlinked; its lock still held here
        # Now a live process (same job and rank) claims the name: it takes the lock
        # of a control file of its own before this removal is done.
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLAIMER), str(stale)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        claimers.append(child)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "locked"

    monkeypatch.setattr(reader, "_remove_pool_files", remove_pool_files)
    try:
        assert remove_stale_pools(shm, "j") == [stale]
        assert len(claimers) == 1
        out, _ = claimers[0].communicate("check\n", timeout=30)
        assert out.split() == ["intact"], out
        assert claimers[0].returncode == 0
    finally:
        for child in claimers:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert sorted(p.name for p in stale.parent.iterdir()) == ["rank-0.4242-abcdef"]


def test_a_second_pool_of_the_same_process_is_told_as_such(
    shm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two Checkpointers of one job and rank in one process: the second stages into
    a sibling directory, and the warning says it is this process's own pool, not
    "another live process" with this process's pid."""
    from ckptd.client.staging.pool import StagingPool

    monkeypatch.setattr("ckptd.client.staging.pool._CLAIM_RETRIES", 0)
    first = StagingPool("j", 0, root=shm)
    try:
        with caplog.at_level("WARNING", logger="ckptd.client.staging.pool"):
            second = StagingPool("j", 0, root=shm)
        try:
            said = " ".join(r.getMessage() for r in caplog.records)
            assert "another pool of this process" in said, said
            assert f"pid {os.getpid()}" not in said
            assert second.directory != first.directory
        finally:
            second.close()
    finally:
        first.close()


def test_a_staging_root_another_user_made_is_refused(shm: Path) -> None:
    """``<shm>/ckptd-<uid>`` made first by someone else (a link to their directory,
    or a directory of theirs) is refused with what to do, before anything is
    staged in it; one of this user's that others may write is closed to them."""
    from ckptd.client.staging.pool import StagingPool
    from ckptd.client.staging.segments import _user_root
    from ckptd.errors import StagingError

    root = _user_root(shm)
    theirs = shm / "theirs"
    theirs.mkdir(mode=0o777)
    root.symlink_to(theirs)
    with pytest.raises(StagingError) as err:
        StagingPool("j", 0, root=shm)
    assert "not a directory" in str(err.value) and "CKPTD_SHM_DIR" in str(err.value)
    assert not any(theirs.iterdir())  # nothing went in
    root.unlink()

    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)  # this user's, but open to all
    pool = StagingPool("j", 0, root=shm)
    try:
        assert os.stat(root).st_mode & 0o777 == 0o700
    finally:
        pool.close()

    if os.getuid() != 0:
        return  # (only root can give a directory to another user)
    root.mkdir(mode=0o700, exist_ok=True)  # (a closed pool takes its empty parents)
    os.chown(root, 4242, 4242)
    try:
        with pytest.raises(StagingError) as err:
            StagingPool("j", 0, root=shm)
        assert "belongs to uid 4242" in str(err.value)
    finally:
        os.chown(root, 0, 0)


def test_stale_pools_are_not_looked_for_under_a_root_another_user_made(shm: Path) -> None:
    """(Found by review.) Removing stale pools under ``<shm>/ckptd-<uid>`` that is a
    link to someone's directory removes nothing there."""
    from ckptd.client.staging.segments import _user_root

    theirs = shm / "theirs"
    pool = theirs / "j" / "rank-0"
    pool.mkdir(parents=True)
    (pool / "seg-0").write_bytes(b"x" * 4096)  # no control file, no live owner
    _user_root(shm).symlink_to(theirs)
    assert remove_stale_pools(shm) == []
    assert (pool / "seg-0").exists()


def test_a_claim_survives_a_clean_removing_the_empty_user_and_job_directories(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Seen once in CI: a clean raced a restarting worker.) A clean removes the
    user's and the job's directories once they are empty; when that happens between
    the claim's mkdir and its open, or after the user's directory was checked, the
    claim makes them again, each private, instead of failing or leaving a directory
    made with the umask's mode."""
    from ckptd.client.staging import segments
    from ckptd.client.staging.pool import StagingPool
    from ckptd.client.staging.segments import _user_root

    root = _user_root(shm)
    real_open = segments.open_own_directory
    vanished: list[Path] = []

    def open_after_a_clean(path: Path) -> int:
        if not vanished:  # the first open finds the directory just removed, empty
            vanished.append(path)
            os.rmdir(path)
        return real_open(path)

    monkeypatch.setattr(segments, "open_own_directory", open_after_a_clean)
    pool = StagingPool("j", 0, root=shm)
    try:
        assert vanished == [root]
        assert pool.directory == pool_dir("j", 0, shm)
        for d in (root, pool.directory.parent, pool.directory):
            assert os.stat(d).st_mode & 0o777 == 0o700, d
    finally:
        pool.close()
    monkeypatch.undo()

    real_root = segments.own_user_root

    def checked_then_cleaned(where: Path | None) -> Path:
        path = real_root(where)
        if len(vanished) == 1:  # checked, then emptied and removed before the mkdirs
            vanished.append(path)
            os.rmdir(path)
        return path

    from ckptd.client.staging import pool as pool_module
    monkeypatch.setattr(pool_module, "own_user_root", checked_then_cleaned)
    old = os.umask(0o022)
    try:
        pool = StagingPool("j", 1, root=shm)
    finally:
        os.umask(old)
    try:
        assert len(vanished) == 2 and pool.directory == pool_dir("j", 1, shm)
        for d in (root, pool.directory.parent, pool.directory):
            assert os.stat(d).st_mode & 0o777 == 0o700, d
    finally:
        pool.close()
