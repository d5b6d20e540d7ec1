"""The command line on a damaged store (found by a probe): damage found is exit 1 in
every command that reports it, a usage mistake or a command that could not run is
exit 2 (docs/operations.md), each said in one or two lines, never a traceback;
``forget`` calls a damaged step damaged, as ``ls`` does; a tenant's words (tensor
names, a tag's) are printed with their control characters written out.

One file:// store, copied per test: job j1, steps 10, 20, 30 (a Linear(64, 32)),
20 tagged ``best``, 30 ``latest``; read directly or through a ``ckptd serve`` over
the copy."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.lifecycle.documents import damage_key
from tests.conftest import ServerProcess
from tests.integration.test_cli_mistakes import assert_short_usage_error, ckptd, ckptd_each

pytestmark = pytest.mark.timeout(240)

JOB = "j1"
WIDE = {"COLUMNS": "400"}  # a table row on one line


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "store"
    shm = tmp_path_factory.mktemp("shm")
    model = torch.nn.Linear(64, 32)
    with Checkpointer(url=f"file://{root}", job=JOB, rank=0, world_size=1, shm_dir=shm,
                      serve_peers=False, heartbeat_interval=0) as ckpt:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.add_(step)
            assert ckpt.save(step, {"model": model.state_dict()}).wait(60).state == "committed"
    done = ckptd("tag", JOB, "20", "best", "--url", f"file://{root}")
    assert done.returncode == 0, done.stdout + done.stderr
    return root


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


@contextlib.contextmanager
def reached(store: Path, via: str) -> Iterator[str]:
    """The URL of ``store`` as it is now: itself, or a server started over it."""
    if via == "file":
        yield f"file://{store}"
        return
    srv = ServerProcess(store=store)
    srv.start()
    try:
        yield srv.url
    finally:
        srv.stop()


def _step(root: Path, step: int) -> Path:
    return root / "jobs" / JOB / "steps" / str(step)


def _weight_chunk(root: Path, step: int) -> Path:
    manifest = json.loads((_step(root, step) / "ranks" / "0.json").read_text())
    cid = next(e for e in manifest["entries"] if e["name"] == "model.weight")["chunks"][0]
    return root / "chunks" / cid[:2] / cid


def _damage(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 1 (damage found), said in one or two lines on stderr, no traceback."""
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "Traceback" not in said, said
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, said
    for needle in needles:
        assert needle in said, said


def _row(out: str, step: int) -> list[str]:
    """The cells of ``step``'s row in a table ``out`` printed."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] == str(step):
            return cells
    raise AssertionError(f"no row for step {step}:\n{out}")


# -- 1. scrub ---------------------------------------------------------------------------


def test_scrub_refuses_a_replica_that_is_not_there_creating_nothing(store: Path,
                                                                    tmp_path: Path) -> None:
    missing = tmp_path / "no" / "replica"
    for replica in (str(missing), f"file://{missing}"):
        done = ckptd("scrub", "--replica", replica, "--url", f"file://{store}")
        assert_short_usage_error(done, "--replica", str(missing))
        assert not (tmp_path / "no").exists()


def test_scrub_refuses_a_replica_that_holds_no_chunks_before_marking_anything(
    store: Path, pristine: Path, tmp_path: Path
) -> None:
    """An empty directory (a wrong path: the s3:// prefix's case is in test_cli_s3) was
    taken as a replica: step 10's corrupt chunk was 'not repaired' and the step marked
    damaged (exit 1), and with no corrupt chunk the scrub said nothing of it (exit 0)."""
    chunk = _weight_chunk(store, 10)
    chunk.chmod(0o644)
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    empty = tmp_path / "empty"
    (empty / "jobs").mkdir(parents=True)  # (no chunks/: a store's start, or another tree)
    refused = ckptd_each(*(["scrub", "--replica", replica, "--url", f"file://{store}"]
                           for replica in (str(empty), f"file://{empty}")))
    for done in refused:
        assert_short_usage_error(done, "--replica", str(empty), "no chunks are stored there")
    assert not (store / damage_key(JOB, 10)).exists()
    # The same scrub with a copy that holds the chunk repairs it.
    done = ckptd("scrub", "--replica", str(pristine), "--url", f"file://{store}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"repaired {chunk.name}" in done.stdout, done.stdout


@pytest.mark.parametrize("via", ["file", "server"])
def test_scrub_says_whose_missing_chunks_are_and_exits_1_on_damage_it_reports(
    store: Path, via: str
) -> None:
    _weight_chunk(store, 30).unlink()  # missing: verify's to find, not scrub's
    cursor = store / "gc" / "scrub"
    cursor.parent.mkdir(exist_ok=True)
    cursor.write_bytes(b"\x00not a cursor")
    with reached(store, via) as url:
        done = ckptd("scrub", "--url", url)
        said = done.stdout + done.stderr
        assert done.returncode == 1, said
        assert "gc/scrub" in done.stdout and "Traceback" not in said, said
        assert "ckptd verify" in done.stdout, said
        # The cursor replaced, a missing chunk is no damage scrub finds: exit 0, and
        # it says which command finds those.
        done = ckptd("scrub", "--url", url)
        said = done.stdout + done.stderr
        assert done.returncode == 0, said
        assert "ckptd verify" in done.stdout, said


# -- 2. exit codes on a damaged store ---------------------------------------------------


@pytest.mark.parametrize("via", ["file", "server"])
def test_damage_found_is_exit_1_in_every_reading_command(store: Path, tmp_path: Path,
                                                         via: str) -> None:
    record = _step(store, 20) / "commit.json"
    record.write_bytes(record.read_bytes()[:40])
    chunk = _weight_chunk(store, 10)  # step 10's own: its bytes no longer its id's
    chunk.chmod(0o644)
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    bad = "jobs/j1/steps/20/commit.json"
    with reached(store, via) as url:
        _damage(ckptd("diff", JOB, "10", "20", "--url", url), "store_corrupt", bad)
        _damage(ckptd("export", JOB, "20", "--zarr", str(tmp_path / "z"), "--url", url),
                "store_corrupt", bad)
        _damage(ckptd("export", JOB, "20", "--safetensors", str(tmp_path / "s"), "--url", url),
                "store_corrupt", bad)
        _damage(ckptd("restore", "--job", JOB, "--rank", "0", "--step", "20", "--to",
                      str(tmp_path / "r"), "--no-peers", "--url", url), "store_corrupt", bad)
        _damage(ckptd("export", JOB, "10", "--safetensors", str(tmp_path / "s"), "--url", url),
                "chunk_hash_mismatch", chunk.name)
        space = ckptd("space", "--url", url)
        assert space.returncode == 1, space.stdout + space.stderr
        assert "damaged" in space.stdout and bad in space.stdout, space.stdout
        for command in (["ls", JOB], ["verify", JOB]):  # (as before)
            done = ckptd(*command, "--url", url)
            assert done.returncode == 1, done.stdout + done.stderr
        # Not damage: a mistake, still exit 2.
        assert_short_usage_error(ckptd("diff", "nojob", "1", "2", "--url", url), "nojob")
        ok = ckptd("diff", JOB, "10", "30", "--url", url)
        assert ok.returncode == 0, ok.stdout + ok.stderr


@pytest.mark.parametrize("via", ["file", "server"])
def test_a_chunk_the_store_lacks_and_a_commit_record_naming_a_bad_job_are_damage(
    store: Path, tmp_path: Path, via: str
) -> None:
    """Found by a probe: a restore of a step whose chunk file is gone said
    restore_failed and exit 2, as for a store it could not read; a commit record
    whose job is no job name said invalid_name (exit 2), blaming the caller, in
    restore, diff, ls and gc."""
    gone = _weight_chunk(store, 30)
    gone.unlink()
    # A chunk whose file does not read (a link that loops, as a disk's EIO would):
    # damage of that chunk (EACCES would be a store this user cannot read: exit 2).
    unread = _weight_chunk(store, 20)
    unread.unlink()
    unread.symlink_to(unread.name)
    record = _step(store, 10) / "commit.json"
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "job": "bad name!"}))
    bad = "jobs/j1/steps/10/commit.json"

    def restore(step: int) -> list[str]:
        return ["restore", "--job", JOB, "--rank", "0", "--step", str(step), "--to",
                str(tmp_path / f"r{step}"), "--no-peers", "--url", url]

    with reached(store, via) as url:
        lacked, unreadable, named, listed = ckptd_each(
            restore(30), restore(20), restore(10), ["ls", JOB, "--url", url], env=WIDE)
        collected = ckptd("gc", "--dry-run", "--url", url)  # (it lists the loop's size)
    _damage(lacked, "restore_failed", gone.name, "missing")
    _damage(unreadable, "restore_failed", unread.name, "cannot read", "ckptd scrub")
    _damage(named, "store_corrupt", bad, "bad name!")
    assert "invalid_name" not in named.stderr, named.stderr
    said = listed.stdout + listed.stderr
    assert listed.returncode == 1, said
    assert _row(listed.stdout, 10)[1] == "damaged" and bad in said, said
    _damage(collected, "store_corrupt", bad, "bad name!")  # (gc reads the records itself)


@pytest.mark.parametrize("via", ["file", "server"])
def test_verify_and_scrub_name_a_chunk_that_does_not_read_and_go_on(
    store: Path, pristine: Path, via: str
) -> None:
    """Found by a probe: a chunk file that is a link looping on itself stopped
    verify, scrub and gc with a traceback (OSError ELOOP), the other chunks unchecked.
    Now verify names it and what it breaks, scrub marks its steps damaged, or with a
    replica puts a good copy in its place, gc counts it, and each goes on."""
    unread = _weight_chunk(store, 20)
    unread.unlink()
    unread.symlink_to(unread.name)
    corrupt = _weight_chunk(store, 10)
    corrupt.chmod(0o644)
    corrupt.write_bytes(b"\xff" + corrupt.read_bytes()[1:])
    with reached(store, via) as url:
        verified, collected = ckptd_each(["verify", JOB, "--url", url],
                                         ["gc", "--dry-run", "--url", url], env=WIDE)
        scrubbed = ckptd("scrub", "--url", url, env=WIDE)
        listed = ckptd("ls", JOB, "--url", url, env=WIDE)
    said = verified.stdout + verified.stderr
    assert verified.returncode == 1 and "Traceback" not in said, said
    assert f"unreadable chunk {unread.name}: breaks step 20 rank 0 model.weight" in said, said
    assert f"corrupt chunk {corrupt.name}" in said, said  # (the rest was checked)
    said = collected.stdout + collected.stderr
    assert collected.returncode == 0 and "would free 0 B" in said, said
    said = scrubbed.stdout + scrubbed.stderr
    assert scrubbed.returncode == 1 and "Traceback" not in said, said
    assert unread.name in said and corrupt.name in said, said
    for step in (10, 20):
        assert (store / damage_key(JOB, step)).exists(), said
        assert _row(listed.stdout, step)[1] == "damaged", listed.stdout
    assert _row(listed.stdout, 30)[1] == "committed", listed.stdout
    if via == "file":  # (a server repairs from CKPTD_SCRUB_REPLICA and its peers)
        done = ckptd("scrub", "--replica", str(pristine), "--url", f"file://{store}")
        said = done.stdout + done.stderr
        assert done.returncode == 0, said
        assert f"repaired {unread.name}" in said and f"repaired {corrupt.name}" in said, said
        assert not unread.is_symlink() and unread.read_bytes() == (
            pristine / unread.relative_to(store)).read_bytes()


# -- 3. forget calls a damaged step damaged ---------------------------------------------


@pytest.mark.parametrize("via", ["file", "server"])
def test_forget_calls_a_step_whose_commit_record_is_lost_damaged(store: Path,
                                                                 via: str) -> None:
    (_step(store, 20) / "commit.json").unlink()  # tagged best: damaged, not pending
    with reached(store, via) as url:
        for args in (["--keep-last", "5"], ["--step", "20"]):
            done = ckptd("forget", JOB, *args, "--dry-run", "--url", url, env=WIDE)
            assert done.returncode == 0, done.stdout + done.stderr
            cells = _row(done.stdout, 20)
            assert cells[1] == "damaged", done.stdout
        listed = ckptd("ls", JOB, "--url", url, env=WIDE)
        assert _row(listed.stdout, 20)[1] == "damaged", listed.stdout


# -- 4. a tenant's control characters ---------------------------------------------------


def test_ls_and_forget_write_out_control_characters_of_a_damage_line(store: Path) -> None:
    # A field the commit record should not have: its name is in the damage said.
    record = _step(store, 20) / "commit.json"
    doc = json.loads(record.read_text())
    doc["be\x1b[2Jst"] = 1
    record.write_text(json.dumps(doc))
    url = f"file://{store}"
    for command in (["ls", JOB], ["forget", JOB, "--step", "20", "--dry-run"]):
        done = ckptd(*command, "--url", url, env=WIDE)
        said = done.stdout + done.stderr
        assert "\x1b" not in said, said
        assert "be\\x1b[2Jst" in said, said


def test_diff_writes_out_control_characters_and_brackets_of_tensor_names(
    tmp_path: Path, shm: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    name = "w\x1b[2J[bold]x"
    with Checkpointer(url, job="e", shm_dir=shm) as ckpt:
        for step in (1, 2):
            state = {name: torch.ones(8) * step, "same": torch.ones(4)}
            assert ckpt.save(step, state).wait(60).state == "committed"
    done = ckptd("diff", "e", "1", "2", "--url", url, env=WIDE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\x1b" not in done.stdout, done.stdout
    assert "w\\x1b[2J[bold]x" in done.stdout, done.stdout


def test_verify_writes_out_control_characters_of_the_tensors_a_bad_chunk_breaks(
    tmp_path: Path, shm: Path
) -> None:
    root = tmp_path / "store"
    name = "w\x1b[2J[bold]x"
    with Checkpointer(f"file://{root}", job="e", shm_dir=shm) as ckpt:
        assert ckpt.save(1, {name: torch.ones(64)}).wait(60).state == "committed"
    manifest = json.loads((root / "jobs" / "e" / "steps" / "1" / "ranks" / "0.json").read_text())
    cid = manifest["entries"][0]["chunks"][0]
    chunk = root / "chunks" / cid[:2] / cid
    chunk.write_bytes(b"\0" * chunk.stat().st_size)
    done = ckptd("verify", "e", "--url", f"file://{root}", env=WIDE)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "\x1b" not in done.stdout, done.stdout
    assert "w\\x1b[2J[bold]x" in done.stdout, done.stdout


def test_scrub_through_a_server_outlasts_the_commands_read_timeout(store: Path) -> None:
    """Found by a probe: through a server, ``ckptd scrub`` of a store larger than
    about 600 MiB always failed with [timeout] after 10 s (the command's read
    timeout), while the server's pass at CKPTD_SCRUB_RATE (64 MiB/s) went on. Here a
    slow rate stands for a large store."""
    size = sum(p.stat().st_size for p in (store / "chunks").rglob("*") if p.is_file())
    rate = max(1, size // 12)  # a pass of ~12 s
    srv = ServerProcess(store=store, env={"CKPTD_SCRUB_RATE": str(rate)})
    srv.start()
    try:
        done = ckptd("scrub", "--url", srv.url)
    finally:
        srv.stop()
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "checked" in done.stdout and "timeout" not in said, said
