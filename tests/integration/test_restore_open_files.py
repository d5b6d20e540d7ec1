"""A restore from chunk files (a ``file://`` store, the cache tier) of more chunks
than the process may hold open files: past a budget, chunks are read instead of
mapped (each map holds a descriptor until the restore ends)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptd.client.restore.sources import DirectoryCacheSource, map_budget

CHILD = textwrap.dedent("""
    import os, resource, sys, warnings
    import torch
    import torch.distributed.checkpoint as dcp
    from ckptd.client import Checkpointer
    from ckptd.client.dcp import Reader

    root, chunks = sys.argv[1], int(sys.argv[2])
    url = f"file://{root}/store"
    state = {"w": torch.randn(chunks * 1024, generator=torch.Generator().manual_seed(1))}
    with Checkpointer(url, "many", chunk_size=4096, serve_peers=False) as ckpt:
        ckpt.save(1, state).wait(timeout=120)
    # Fewer open files than chunks, as under a common `ulimit -n 1024` with a
    # restore of more than 4 GiB of 4 MiB chunks.
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    for atomic in (True, False):
        target = {"w": torch.zeros_like(state["w"])}
        with Checkpointer(url, "many", serve_peers=False) as ckpt:
            result = ckpt.restore(target, tiers=("store",), atomic=atomic)
        assert result.chunks == chunks, result
        assert torch.equal(target["w"], state["w"]), atomic
    target = {"w": torch.zeros_like(state["w"])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=Reader(url, "many", 1), no_dist=True)
    assert torch.equal(target["w"], state["w"]), "dcp"
    print("OK")
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX open-file limits")
def test_a_restore_of_more_chunks_than_open_files_succeeds(tmp_path: Path) -> None:
    env = {**os.environ, "CKPTD_SHM_DIR": str(tmp_path / "shm")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), "600"],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_chunks_past_the_budget_are_read_not_mapped(tmp_path: Path) -> None:
    chunks = tmp_path / "chunks"
    ids = []
    for k in range(5):
        cid = f"{k:064x}"
        (chunks / cid[:2]).mkdir(parents=True, exist_ok=True)
        (chunks / cid[:2] / cid).write_bytes(bytes([k]) * (1000 + k))
        ids.append(cid)
    source = DirectoryCacheSource(tmp_path, max_maps=2)
    views = [source._map(source._path(cid), cid) for cid in ids]
    assert [bytes(v) for v in views] == [bytes([k]) * (1000 + k) for k in range(5)]
    assert len(source._maps) == 2  # the rest hold no descriptor
    source.close()


def test_the_budget_follows_the_open_file_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert map_budget() == 64
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_chunk_file_whose_pages_cannot_be_read_in_is_read_not_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page the disk cannot give back (an I/O error: absent hardware here, so the
    read-in's answer stands in for it) must not stay mapped, where touching it would
    be a SIGBUS: the chunk is read, where an error is an OSError."""
    import ckptd.client.restore.sources as sources

    cid = f"{7:064x}"
    (tmp_path / "chunks" / cid[:2]).mkdir(parents=True)
    (tmp_path / "chunks" / cid[:2] / cid).write_bytes(b"x" * 10_000)
    monkeypatch.setattr(sources, "populate_read", lambda view: False)
    source = DirectoryCacheSource(tmp_path)
    view = source._map(source._path(cid), cid)
    assert bytes(view) == b"x" * 10_000
    assert source._maps == []  # read into memory, not mapped
    source.close()
