"""Today's code reads the committed format-v1 store bit for bit, and would write it again.

If a test here fails after a change, the on-store format changed: that needs a new
format version and a "Changes" entry in docs/FORMAT.md, not a regenerated golden.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import blake3
import pytest

from ckptd.errors import NotCommitted
from ckptd.format import CommitRecord, RankManifest, Ref, canonical_json
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.validation import validate_step

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden-v1"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckptd_make_golden", DATA / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def files_of(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN, copy)  # the committed copy stays untouched
    return Repository(LocalStore(copy, fsync=False))


def step_dir(step: int) -> Path:
    return GOLDEN / "jobs" / gen.JOB / "steps" / str(step)


# -- reading -------------------------------------------------------------------------------


async def test_latest_is_the_newest_committed_step(repo: Repository) -> None:
    assert await repo.latest(gen.JOB) == 2
    raw = (GOLDEN / "jobs" / gen.JOB / "refs" / "latest").read_bytes()
    ref = Ref.parse(raw)
    assert raw == ref.canonical()
    commit = (step_dir(2) / "commit.json").read_bytes()
    assert ref.commit == blake3.blake3(commit).hexdigest()
    assert await repo.list_jobs() == [gen.JOB]


@pytest.mark.parametrize("step", [1, 2])
async def test_commit_records_and_manifests_are_bitwise_canonical(
    repo: Repository, step: int
) -> None:
    raw = (step_dir(step) / "commit.json").read_bytes()
    record = await repo.read_commit(gen.JOB, step)
    assert record.canonical() == raw
    assert CommitRecord.parse(raw) == record
    assert record.committed_at == gen.COMMITTED_AT
    assert record.world_size == gen.WORLD_SIZE
    assert record.meta == {"reason": "golden"}
    manifests = []
    for rank in range(gen.WORLD_SIZE):
        data = (step_dir(step) / "ranks" / f"{rank}.json").read_bytes()
        manifest = RankManifest.parse(data)
        assert manifest.canonical() == data
        assert record.manifests[rank].hash == blake3.blake3(data).hexdigest()
        assert record.manifests[rank].size == len(data)
        assert await repo.read_manifest(gen.JOB, step, rank) == manifest
        expected, _ = gen.rank_manifest(step, rank)
        assert manifest == expected
        manifests.append(manifest)
    assert validate_step(manifests) == record.report


@pytest.mark.parametrize("step", [1, 2])
async def test_every_chunk_is_the_generators_bytes(repo: Repository, step: int) -> None:
    for rank in range(gen.WORLD_SIZE):
        manifest = await repo.read_manifest(gen.JOB, step, rank)
        for entry in manifest.entries:
            expected = gen.tensor_bytes(entry.name, step, rank)
            pieces = [await repo.get_chunk(cid) for cid in entry.chunks]
            assert b"".join(pieces) == expected
            assert [len(p) for p in pieces[:-1]] == [gen.CHUNK_SIZE] * (len(pieces) - 1)
            for cid, piece in zip(entry.chunks, pieces, strict=True):
                path = GOLDEN / "chunks" / cid[:2] / cid
                assert path.read_bytes() == piece  # b3sum checks a chunk by its name
                assert blake3.blake3(piece).hexdigest() == cid


async def test_what_the_golden_store_holds(repo: Repository) -> None:
    one = await repo.read_manifest(gen.JOB, 1, 0)
    two = await repo.read_manifest(gen.JOB, 2, 0)
    r1 = await repo.read_manifest(gen.JOB, 2, 1)
    by_name = {e.name: e for e in two.entries}
    embed, mlp, rng = by_name[gen.EMBED], by_name[gen.MLP], by_name[gen.RNG]
    assert (embed.dtype, embed.placement, len(embed.chunks)) == ("float32", "replicated", 3)
    assert (mlp.dtype, mlp.placement, mlp.shape, mlp.offsets) == (
        "bfloat16", "sharded", [48, 48], [0, 0]
    )
    assert {e.name: e for e in r1.entries}[gen.MLP].offsets == [48, 0]
    assert (rng.dtype, rng.placement) == ("int64", "local")
    # replicas share chunks; step 2 changed only the last row of the replicated tensor
    assert {e.name: e for e in r1.entries}[gen.EMBED].chunks == embed.chunks
    old = {e.name: e for e in one.entries}[gen.EMBED].chunks
    assert old[:2] == embed.chunks[:2] and old[2] != embed.chunks[2]
    # the tree keeps an integer key, NaN and infinities, None, a tuple, non-ASCII text
    text = canonical_json(two.tree).decode()
    for piece in ('[0,{"dict"', '{"float":"nan"}', '{"float":"-inf"}', '{"value":null}',
                  '{"tuple":', "héllo"):
        assert piece in text


async def test_the_pending_step_is_pending(repo: Repository) -> None:
    with pytest.raises(NotCommitted):
        await repo.read_commit(gen.JOB, gen.PENDING_STEP)
    steps = await repo.list_steps(gen.JOB)
    assert [(s.step, s.committed, s.is_latest) for s in steps] == [
        (1, True, False), (2, True, True), (3, False, False),
    ]
    assert steps[2].ranks_present == 1 and steps[2].world_size == 2


async def test_verify_passes(repo: Repository) -> None:
    report = await repo.verify(gen.JOB)
    assert report.ok and report.steps == [1, 2]
    assert report.chunks_checked == 16  # 9 in step 1, 7 new in step 2


def test_no_stray_objects() -> None:
    referenced: set[str] = set()
    for manifest_path in GOLDEN.glob("jobs/*/steps/*/ranks/*.json"):
        for entry in RankManifest.parse(manifest_path.read_bytes()).entries:
            referenced.update(entry.chunks)
    chunk_files = {p.name for p in (GOLDEN / "chunks").rglob("*") if p.is_file()}
    assert chunk_files == referenced
    names = set(files_of(GOLDEN))
    assert not any("/.tmp-" in n or n.startswith(".") for n in names)


def test_documents_have_exactly_the_documented_fields() -> None:
    # docs/FORMAT.md lists these fields; a field added or dropped is a format change.
    manifest = json.loads((step_dir(2) / "ranks" / "0.json").read_bytes())
    assert sorted(manifest) == [
        "chunk_size", "entries", "format", "job", "meta", "rank", "step", "tree", "version",
        "world_size",
    ]
    assert sorted(manifest["entries"][0]) == [
        "chunks", "dtype", "global_shape", "name", "nbytes", "offsets", "placement", "shape",
    ]
    record = json.loads((step_dir(2) / "commit.json").read_bytes())
    assert sorted(record) == [
        "committed_at", "format", "job", "manifests", "meta", "report", "step", "version",
        "world_size",
    ]
    assert sorted(record["manifests"][0]) == ["hash", "rank", "size"]
    assert sorted(record["report"]) == [
        "chunks", "local_entries", "logical_bytes", "replicated_entries", "sharded_entries",
        "tensors", "warnings",
    ]
    ref = json.loads((GOLDEN / "jobs" / gen.JOB / "refs" / "latest").read_bytes())
    assert sorted(ref) == ["commit", "format", "step", "version"]


# -- writing -------------------------------------------------------------------------------


def test_regenerating_gives_identical_files(tmp_path: Path) -> None:
    out = tmp_path / "again"
    gen.generate(out)
    assert files_of(out) == files_of(GOLDEN)
