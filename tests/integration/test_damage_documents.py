"""Documents beside a job's checkpoints that stop a flow when they do not read, as an
operator probe met them in a copy of the golden store: verify names them (exit 1),
scrub says what it did with them, and one of a newer ckptd is said to be a newer
ckptd's and left as it is, never overwritten, never taken for something else."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from ckptd.format import canonical_json
from ckptd.hashing import document_hash
from tests.integration.test_damage_timeline import GOLDEN, cli, life, row

pytestmark = pytest.mark.timeout(120)

DAMAGE = "jobs/golden/damage/2.json"


def golden(tmp_path: Path) -> Path:
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN, root)
    return root


def as_version_2(path: Path) -> bytes:
    data = path.read_bytes().replace(b'"version":1', b'"version":2')
    path.write_bytes(data)
    return data


def test_verify_names_a_pending_manifest_that_does_not_parse(tmp_path: Path) -> None:
    """Before, verify said ok while gc stopped on it with store_corrupt."""
    root = golden(tmp_path)
    (root / "jobs/golden/steps/3/ranks/0.json").write_bytes(b"xx\n")
    code, out = cli(root, "verify", "golden")
    assert code == 1, out
    assert "bad manifest step 3 rank 0" in out and "steps/3/ranks/0.json" in out, out
    assert "ckptd forget golden --step 3" in out, out


def test_a_damage_marker_that_does_not_parse_is_named_and_kept(tmp_path: Path) -> None:
    """verify names it; scrub reads every chunk good, says the marker is unreadable
    and what to do, and keeps it (a claim of damage it cannot check)."""
    root = golden(tmp_path)
    (root / "jobs/golden/damage").mkdir()
    (root / DAMAGE).write_bytes(b"xx\n")
    code, out = cli(root, "verify", "golden")
    assert code == 1 and DAMAGE in out, out
    code, out = cli(root, "scrub")
    assert code == 1 and DAMAGE in out and "left as it is" in out, out
    assert "delete the marker" in out, out
    assert (root / DAMAGE).read_bytes() == b"xx\n"


def test_a_newer_damage_marker_is_said_and_left(tmp_path: Path) -> None:
    root = golden(tmp_path)
    (root / "jobs/golden/damage").mkdir()
    marker = canonical_json({"format": "ckptd.damage", "version": 2, "job": "golden",
                             "step": 2, "chunks": [], "found_at": 1.0})
    (root / DAMAGE).write_bytes(marker)
    code, out = cli(root, "verify", "golden")
    assert code == 1 and DAMAGE in out and "upgrade ckptd" in out, out
    code, out = cli(root, "scrub")
    assert code == 1 and DAMAGE in out and "upgrade ckptd" in out, out
    assert (root / DAMAGE).read_bytes() == marker


def test_a_newer_scrub_cursor_is_left_as_gc_state_is(tmp_path: Path) -> None:
    """Before, scrub said it did not parse, replaced it and reset its passes."""
    root = life(tmp_path)
    cursor = as_version_2(root / "gc/scrub")
    code, out = cli(root, "scrub")
    assert code != 0 and "[unsupported_stored_format]" in out and "gc/scrub" in out, out
    assert "upgrade ckptd" in out and "does not parse" not in out, out
    assert (root / "gc/scrub").read_bytes() == cursor


def with_newer_manifest(root: Path) -> Path:
    """Step 2's rank 0 manifest as version 2, its commit record (and latest) naming
    those bytes: what a newer ckptd would have committed."""
    jobs = root / "jobs/golden"
    manifest = as_version_2(jobs / "steps/2/ranks/0.json")
    record = json.loads((jobs / "steps/2/commit.json").read_bytes())
    record["manifests"][0]["hash"] = document_hash(manifest)
    (jobs / "steps/2/commit.json").write_bytes(canonical_json(record))
    ref = json.loads((jobs / "refs/latest").read_bytes())
    ref["commit"] = document_hash(canonical_json(record))
    (jobs / "refs/latest").write_bytes(canonical_json(ref))
    return root


def test_a_newer_latest_manifest_is_listed_as_unsupported(tmp_path: Path) -> None:
    """A rank manifest of version 2 whose bytes its commit record names: restore, gc
    and verify refuse it; the listing showed it committed and latest (exit 0)."""
    root = with_newer_manifest(golden(tmp_path))
    code, out = cli(root, "ls", "golden")
    assert code == 1 and "unsupported" in row(out, 2) and "latest" not in row(out, 2), out
    assert "steps/2/ranks/0.json" in out and "upgrade ckptd" in out, out


def test_space_does_not_count_a_newer_manifest(tmp_path: Path) -> None:
    """Before, space counted its entries as if they were of version 1 (exit 0)."""
    root = with_newer_manifest(golden(tmp_path))
    code, out = cli(root, "space")
    assert code == 1 and "steps/2/ranks/0.json" in out and "newer ckptd" in out, out


def test_a_newer_removal_claim_is_said_at_once(tmp_path: Path) -> None:
    """Before, tagging waited 30 s and then said the step was removed by retention
    (it was committed and restored)."""
    root = golden(tmp_path)
    claim = root / "jobs/golden/steps/2/removing.json"
    claim.write_bytes(canonical_json({"format": "ckptd.removal", "version": 2,
                                      "since": time.time(), "token": "ab" * 16}))
    began = time.monotonic()
    code, out = cli(root, "tag", "golden", "2", "other")
    assert time.monotonic() - began < 10, out
    assert code != 0 and "[unsupported_stored_format]" in out, out
    assert "removing.json" in out and "upgrade ckptd" in out, out
    assert "removed by retention" not in out, out
    assert "other" not in (root / "jobs/golden/refs/tags").read_text() \
        if (root / "jobs/golden/refs/tags").exists() else True
    assert (root / "jobs/golden/steps/2/commit.json").exists()


def test_retention_never_takes_over_a_newer_removal_claim_however_old(tmp_path: Path) -> None:
    """(A pass took a claim older than 600 s over by compare-and-swap whatever its
    version: a newer ckptd's claim, whose removal this one cannot judge.)"""
    root = golden(tmp_path)
    claim = root / "jobs/golden/steps/1/removing.json"
    held = canonical_json({"format": "ckptd.removal", "version": 2,
                           "since": time.time() - 7200, "token": "ab" * 16})
    claim.write_bytes(held)
    code, out = cli(root, "forget", "golden", "--keep-last", "1")
    assert "Traceback" not in out, out
    assert claim.read_bytes() == held, out
    assert (root / "jobs/golden/steps/1/commit.json").exists(), out


def test_scrub_leaves_a_newer_marker_on_a_step_it_finds_damaged(tmp_path: Path) -> None:
    """Marking a step whose marker a newer ckptd wrote: before, the marker's
    unsupported_stored_format ended the scrub (its report and cursor lost); now the
    corrupt chunk is said, the marker left as it is, and the other steps marked."""
    root = golden(tmp_path)
    (root / "jobs/golden/damage").mkdir()
    marker = canonical_json({"format": "ckptd.damage", "version": 2, "job": "golden",
                             "step": 2, "chunks": [], "found_at": 1.0})
    (root / DAMAGE).write_bytes(marker)
    both = set.intersection(*(
        {c for e in json.loads((root / f"jobs/golden/steps/{s}/ranks/0.json").read_bytes())
         ["entries"] for c in e["chunks"]} for s in (1, 2)))
    bad = sorted(both)[0]  # a chunk steps 1 and 2 name
    chunk = root / "chunks" / bad[:2] / bad
    chunk.chmod(0o644)
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    code, out = cli(root, "scrub")
    assert code == 1 and f"corrupt {bad}" in out, out
    assert DAMAGE in out and "upgrade ckptd" in out and "Traceback" not in out, out
    assert (root / DAMAGE).read_bytes() == marker
    assert bad in (root / "jobs/golden/damage/1.json").read_text()
    assert (root / "gc/scrub").exists()
