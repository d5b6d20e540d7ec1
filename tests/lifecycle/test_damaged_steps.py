"""A damaged committed step is the operator's to forget, never garbage collection's
or retention's (docs/operations.md): a rank manifest missing, not the committed
bytes, or a commit record that does not parse stops ``ckptd gc`` before it deletes
a chunk, naming the document and ``ckptd forget JOB --step N``; a step a tag or
``latest`` names whose commit record is lost is damaged, not pending: ``verify``
and ``ls`` say so and retention does not abandon it.

One file:// store, copied per test: job j1, steps 10, 20, 30 (a Linear(64,32) and
its SGD state), 20 tagged ``best``, 30 ``latest``; step 30's weight chunk is the
only copy of its bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from tests.cli_runs import ckptd as run_ckptd

pytestmark = pytest.mark.timeout(180)

JOB = "j1"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "store"
    shm = tmp_path_factory.mktemp("shm")
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(url=f"file://{root}", job=JOB, rank=0, world_size=1, shm_dir=shm,
                      serve_peers=False, heartbeat_interval=0) as ckpt:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.add_(step)
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            assert ckpt.save(step, state).wait(timeout=60).state == "committed"
    assert _ckptd(root, "tag", JOB, "20", "best").returncode == 0
    return root


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


def _ckptd(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_ckptd(*args, "--url", f"file://{root}", environ={**os.environ, "COLUMNS": "400"},
                     timeout=120)


def _chunks(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "chunks").rglob("*") if p.is_file())


def _manifest(root: Path, step: int) -> Path:
    return root / "jobs" / JOB / "steps" / str(step) / "ranks" / "0.json"


def _record(root: Path, step: int) -> Path:
    return root / "jobs" / JOB / "steps" / str(step) / "commit.json"


def _stops_gc(root: Path, key: str, step: int) -> None:
    """``gc`` (dry or not) fails as store damage naming ``key`` and the way out,
    and deletes nothing."""
    before = _chunks(root)
    for dry in (["--dry-run"], []):
        out = _ckptd(root, "gc", "--grace", "0", *dry)
        assert out.returncode != 0, out.stdout + out.stderr
        assert "store_corrupt" in out.stderr and key in out.stderr, out.stderr
        assert f"ckptd forget {JOB} --step {step}" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    assert _chunks(root) == before


@pytest.mark.parametrize("step", [30, 20], ids=["latest", "tagged"])
@pytest.mark.parametrize("how", ["deleted", "a-directory", "another-step's"])
def test_gc_stops_at_a_committed_step_whose_manifest_is_missing_or_not_its_own(
    store: Path, step: int, how: str,
) -> None:
    manifest = _manifest(store, step)
    saved = manifest.read_bytes()
    manifest.unlink()
    if how == "a-directory":
        manifest.mkdir()
    elif how == "another-step's":  # a valid manifest, but not the one committed
        manifest.write_bytes(_manifest(store, 10).read_bytes())
    _stops_gc(store, f"jobs/{JOB}/steps/{step}/ranks/0.json", step)
    # The manifest put back from a backup: the step is whole again.
    if manifest.is_dir():
        manifest.rmdir()
    manifest.write_bytes(saved)
    out = _ckptd(store, "verify", JOB)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gc_goes_on_once_the_damaged_step_is_forgotten(store: Path) -> None:
    _manifest(store, 30).unlink()
    _stops_gc(store, f"jobs/{JOB}/steps/30/ranks/0.json", 30)
    out = _ckptd(store, "forget", JOB, "--step", "30")
    assert out.returncode == 0, out.stdout + out.stderr
    out = _ckptd(store, "gc", "--grace", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "in 1 chunks" in out.stdout, out.stdout  # step 30's own chunk, now garbage
    out = _ckptd(store, "verify", JOB)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gc_stops_at_a_commit_record_that_does_not_parse(store: Path) -> None:
    record = _record(store, 20)
    record.write_bytes(record.read_bytes()[:40])
    _stops_gc(store, f"jobs/{JOB}/steps/20/commit.json", 20)


def test_a_tagged_step_that_lost_its_commit_record_is_damaged_not_pending(
    store: Path,
) -> None:
    _record(store, 20).unlink()
    for step in ([], ["20"]):
        out = _ckptd(store, "verify", JOB, *step)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "tag best" in out.stdout and "steps/20/commit.json" in out.stdout, out.stdout
    out = _ckptd(store, "ls", JOB)
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {line.split()[1]: line for line in out.stdout.splitlines()
            if line.split()[1:2] and line.split()[1].isdigit()}
    assert "damaged" in rows["20"] and "pending" not in rows["20"], out.stdout
    # Retention keeps it (its chunks may be the only copy); the operator forgets it.
    retention = store.parent / "r.toml"
    retention.write_text('[retention]\nkeep_last = 5\nabandon_pending_after = "1s"\n')
    out = _ckptd(store, "forget", JOB, "--retention", str(retention))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "forgot 0 steps" in out.stdout, out.stdout
    assert _manifest(store, 20).is_file()
    out = _ckptd(store, "forget", JOB, "--step", "20")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not _manifest(store, 20).exists()


@pytest.mark.parametrize("damage", ["latest-record-lost", "record-truncated"])
def test_retention_does_not_abandon_a_step_whose_commit_record_is_damaged(
    store: Path, damage: str,
) -> None:
    step = 30 if damage == "latest-record-lost" else 20
    record = _record(store, step)
    if damage == "latest-record-lost":
        record.unlink()
    else:
        record.write_bytes(record.read_bytes()[:40])
    retention = store.parent / "r.toml"
    retention.write_text('[retention]\nkeep_last = 5\nabandon_pending_after = "1s"\n')
    out = _ckptd(store, "forget", JOB, "--retention", str(retention), "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "would forget 0 steps" in out.stdout, out.stdout
    assert f"ckptd forget {JOB} --step {step}" in out.stdout
    out = _ckptd(store, "ls", JOB)
    assert out.returncode == 1, out.stdout + out.stderr
