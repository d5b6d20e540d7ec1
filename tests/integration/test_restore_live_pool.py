"""A restore that reads this host's live staging pool while its owner stages into
it again: what lands in the target (or in ``ckptd restore --to DIR``) is only
ever bytes that verified, wherever the pool's change falls."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.client import Checkpointer, Shard
from ckptd.client.dcp import Reader
from ckptd.client.dcp import reader as reader_mod
from ckptd.client.restore import fetch, restore_command, restorer, sources
from ckptd.client.staging import StagingPool
from ckptd.errors import Timeout

CHUNK = 64 << 10


@pytest.fixture(autouse=True)
def _own_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_SHM_DIR", str(tmp_path / "shm"))


def _stage_over(pool: StagingPool) -> Callable[[], None]:
    """What a live owner's next stage does to the pool: new bytes everywhere, under
    the seqlock (the generation moves)."""

    def stage() -> None:
        g = pool._begin_write()
        for seg in pool._segments:
            seg.mm[:] = os.urandom(len(seg.mm))
        pool._end_write(g)

    return stage


def test_an_elastic_box_is_cut_again_when_the_pool_changed_during_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 4 * CHUNK // 4  # four chunks of float32
    full = torch.randn(n, generator=torch.Generator().manual_seed(3))
    url = f"file://{tmp_path / 'store'}"
    writer = Checkpointer(url, "el", chunk_size=CHUNK, serve_peers=False)
    writer.save(1, {"w": full}).wait(timeout=60)
    stage = _stage_over(writer.staging)
    real = restorer.deliver

    async def deliver_while_a_stage_runs(*args: Any, **kw: Any) -> None:
        stage()
        await real(*args, **kw)

    monkeypatch.setattr(restorer, "deliver", deliver_while_a_stage_runs)
    lo, hi = n // 4 + 7, 3 * n // 4 + 7  # across chunks: cut from an assembled box
    target = {"w": torch.zeros(hi - lo)}
    try:
        with Checkpointer(url, "el", serve_peers=False) as ckpt:
            result = ckpt.restore(target, shards={"w": Shard((n,), (lo,))},
                                  tiers=("local", "store"))
    finally:
        writer.close()
    assert result.elastic and result.bytes_from.get("local", 0) > 0
    assert torch.equal(target["w"].view(torch.int32), full[lo:hi].view(torch.int32))


def test_dcp_load_copies_a_repeated_chunk_from_its_verified_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'store'}"
    state = {"z": torch.zeros(4 * CHUNK // 4)}  # four chunks with one id
    writer = Checkpointer(url, "dz", chunk_size=CHUNK, serve_peers=False)
    writer.save(1, state).wait(timeout=60)
    stage = _stage_over(writer.staging)
    real = reader_mod.deliver

    async def deliver_while_a_stage_runs(*args: Any, **kw: Any) -> None:
        stage()
        await real(*args, **kw)

    monkeypatch.setattr(reader_mod, "deliver", deliver_while_a_stage_runs)
    target = {"z": torch.full_like(state["z"], 7.0)}
    reader = Reader(url, "dz")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=reader, no_dist=True)
    finally:
        writer.close()
    assert reader.bytes_from.get("local", 0) > 0
    assert torch.equal(target["z"], state["z"])


def test_restore_to_a_directory_stores_only_bytes_that_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'store'}"
    state = {"w": torch.randn(4 * CHUNK // 4, generator=torch.Generator().manual_seed(5))}
    writer = Checkpointer(url, "pf", chunk_size=CHUNK, serve_peers=False)
    writer.save(1, state).wait(timeout=60)
    stage = _stage_over(writer.staging)
    staged: list[int] = []

    def copying_while_a_stage_runs(real: Callable[..., Any]) -> Callable[..., Any]:
        def copy(dest: memoryview, src: memoryview) -> Any:
            if not staged:  # the owner stages once, as the first chunk is copied
                staged.append(1)
                stage()
            return real(dest, src)

        return copy

    monkeypatch.setattr(fetch, "copy_bytes", copying_while_a_stage_runs(fetch.copy_bytes))
    monkeypatch.setattr(sources, "copy_bytes", copying_while_a_stage_runs(sources.copy_bytes))
    out = tmp_path / "dir"
    try:
        restore_command(url, "pf", 0, out, progress=False)
    finally:
        writer.close()
    assert staged
    bad = [p.name for p in (out / "chunks").rglob("*")
           if p.is_file() and blake3.blake3(p.read_bytes()).hexdigest() != p.name]
    assert not bad, f"chunks that do not hash to their ids: {bad}"


def test_a_deadline_that_passes_during_delivery_says_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"t{i}": torch.randn(8 * CHUNK // 4, generator=torch.Generator().manual_seed(i))
             for i in range(4)}
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "j", chunk_size=CHUNK, serve_peers=False) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
    real = fetch._memmove

    def slow_copies(run: tuple[int, int, int]) -> None:
        real(run)
        time.sleep(0.3)  # a slow delivery (GiBs on a loaded host)

    monkeypatch.setattr(fetch, "_memmove", slow_copies)
    monkeypatch.setattr(fetch, "COPY_PIECE_MIN", CHUNK)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(url, "j", serve_peers=False) as ckpt, pytest.raises(Timeout) as info:
        ckpt.restore(target, tiers=("store",), timeout=0.5)
    assert any(v.view(torch.int32).any() for v in target.values()), "delivery never began"
    assert info.value.detail.get("partial") is True
    assert info.value.detail.get("step") == 1
    assert "partly restored" in str(info.value)
