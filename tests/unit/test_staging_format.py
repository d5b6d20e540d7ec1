"""The staging pool's on-disk format (docs/FORMAT.md, "Staging pool"): today's code
reads the committed golden pool, would write it again, and refuses a pool of
another version with a typed error.

If a test here fails after a change, the pool format changed: that needs a new
pool version, not a regenerated golden pool.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ckptd.client.restore.sources import LocalPoolSource
from ckptd.client.staging.format import (
    CONTROL_NAME,
    INDEX_NAME,
    POOL_VERSION,
    ControlHeader,
    PoolIndex,
)
from ckptd.client.staging.pool import StagingPool
from ckptd.client.staging.segments import pool_dir
from ckptd.errors import InvalidDocument, UnsupportedFormat
from ckptd.format import TensorEntry
from ckptd.hashing import chunk_id

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden-pool-v1"


def _load_generator() -> ModuleType:
    path = DATA / "make_golden_pool.py"
    spec = importlib.util.spec_from_file_location("ckptd_make_golden_pool", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def installed(root: Path) -> Path:
    """The golden pool, copied where a restarted worker of its job and rank finds it."""
    directory = pool_dir(gen.JOB, gen.RANK, root)
    shutil.copytree(GOLDEN, directory)
    return directory


def golden_tensors() -> list[tuple[str, torch.Tensor]]:
    w = torch.frombuffer(bytearray(gen.w_bytes()), dtype=torch.float32).view(gen.W_SHAPE)
    b = torch.frombuffer(bytearray(gen.b_bytes()), dtype=torch.bfloat16).view(gen.B_SHAPE)
    return [(gen.W, w), (gen.B, b)]


def test_the_generator_writes_the_committed_golden_pool_byte_for_byte() -> None:
    files = gen.golden_files()
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(files)
    for name, data in files.items():
        assert (GOLDEN / name).read_bytes() == data, name


def test_todays_reader_reads_the_golden_pool(tmp_path: Path) -> None:
    installed(tmp_path)
    reader = StagingPool.open_existing(gen.JOB, gen.RANK, tmp_path)
    assert reader is not None
    with reader:
        assert isinstance(reader.index, PoolIndex)
        assert (reader.step, reader.state, reader.generation()) == (1, "staged", 2)
        assert reader.consistent()
        chunks = list(reader.chunks())
        assert [(name, k) for name, k, _, _ in chunks] == [
            (gen.W, 0), (gen.W, 1), (gen.W, 2), (gen.B, 0)]
        for _, _, cid, data in chunks:
            assert chunk_id(data) == cid
        w = b"".join(bytes(data) for name, _, _, data in chunks if name == gen.W)
        assert w == gen.w_bytes()
    # The restore's local tier finds every chunk in it, located by the index.
    entries = [(TensorEntry(name=n, dtype=d, placement="replicated", global_shape=list(s),
                            offsets=[0] * len(s), shape=list(s), nbytes=len(raw),
                            chunks=list(gen.chunk_ids(raw))), gen.CHUNK_SIZE)
               for n, d, s, raw in ((gen.W, "float32", gen.W_SHAPE, gen.w_bytes()),
                                    (gen.B, "bfloat16", gen.B_SHAPE, gen.b_bytes()))]
    source = LocalPoolSource.open(gen.JOB, gen.RANK, entries, tmp_path)
    assert source is not None
    try:
        for e, _ in entries:
            for cid in e.chunks:
                (holder,) = source.holders(cid)
                assert chunk_id(source.bytes_of(holder)) == cid
    finally:
        source.close()


def test_todays_writer_lays_out_and_indexes_the_golden_tensors_the_same_way(
    tmp_path: Path,
) -> None:
    pool = StagingPool(gen.JOB, gen.RANK, root=tmp_path)
    try:
        plan = pool.prepare(golden_tensors(), gen.CHUNK_SIZE)
        piece = pool.stage(plan, 0, step=gen.STEP)
        piece.wait_copied()
        piece.publish([gen.chunk_ids(gen.w_bytes()), gen.chunk_ids(gen.b_bytes())])
        written = PoolIndex.parse((pool.directory / INDEX_NAME).read_bytes())
        control = ControlHeader.unpack((pool.directory / CONTROL_NAME).read_bytes())
        segment = (pool.directory / written.segments[0].file).read_bytes()
    finally:
        pool.close()
    # The pid and the segment's name and size are the writer's own; all else is golden.
    assert len(written.segments) == 1 and all(
        e.segment == written.segments[0].file for e in written.entries)
    normal = dataclasses.replace(
        written, pid=0,
        segments=(dataclasses.replace(written.segments[0], file=gen.SEGMENT,
                                      nbytes=gen.SEGMENT_BYTES),),
        entries=tuple(dataclasses.replace(e, segment=gen.SEGMENT) for e in written.entries),
    )
    assert normal.encode() == (GOLDEN / INDEX_NAME).read_bytes()
    assert control.generation == gen.GENERATION and control.version == POOL_VERSION
    golden_segment = (GOLDEN / gen.SEGMENT).read_bytes()
    for e in written.entries:
        n = e.end - e.start
        assert segment[e.offset : e.offset + n] == golden_segment[e.offset : e.offset + n]


def test_a_pool_of_another_version_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    directory = installed(tmp_path)
    index = json.loads((directory / INDEX_NAME).read_text())
    index["version"] = POOL_VERSION + 1
    (directory / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(UnsupportedFormat) as info:
        StagingPool.open_existing(gen.JOB, gen.RANK, tmp_path)
    assert info.value.detail["document"] == str(directory / INDEX_NAME)
    assert info.value.detail["version"] == POOL_VERSION + 1

    # The control file carries the version too (its magic's last digit).
    shutil.copy(GOLDEN / INDEX_NAME, directory / INDEX_NAME)
    control = bytearray((directory / CONTROL_NAME).read_bytes())
    control[7:8] = str(POOL_VERSION + 1).encode()
    (directory / CONTROL_NAME).write_bytes(bytes(control))
    with pytest.raises(UnsupportedFormat) as info:
        StagingPool.open_existing(gen.JOB, gen.RANK, tmp_path)
    assert info.value.detail["document"] == str(directory / CONTROL_NAME)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.update(extra=1),  # an unknown field
        lambda d: d.pop("chunk_size"),  # a missing one
        lambda d: d.update(state="torn"),
        lambda d: d["entries"][0].update(segment="../../etc/passwd"),
        lambda d: d["entries"][0].update(end=10**9),
        lambda d: d.update(format="something.else"),
    ],
)
def test_a_damaged_index_is_invalid_and_the_pool_is_not_offered(
    tmp_path: Path, damage: object
) -> None:
    directory = installed(tmp_path)
    doc = json.loads((directory / INDEX_NAME).read_text())
    damage(doc)  # type: ignore[operator]
    data = json.dumps(doc).encode()
    with pytest.raises(InvalidDocument) as info:
        PoolIndex.parse(data)
    assert not isinstance(info.value, UnsupportedFormat)
    (directory / INDEX_NAME).write_bytes(data)
    assert StagingPool.open_existing(gen.JOB, gen.RANK, tmp_path) is None
