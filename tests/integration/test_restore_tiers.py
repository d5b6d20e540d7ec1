"""Tiered restore (``ckptd.client.restore``): a restarted worker re-adopts its
shared-memory pool (only the chunks that verify), a local directory cache, peers
(spread, hash-checked, a dead or lying peer skipped), the store last; the result is
bitwise the committed state or a typed error. Elastic restore: a step saved by 4
ranks restored by 2 (and by 3, and by 1), slices cut from the overlapping chunks.
``restore_command`` pre-fetches a rank into a local directory store."""

from __future__ import annotations

import io
import os
import signal
import struct
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from rich.console import Console
from test_client_common import assert_bitwise, snapshot

from ckptd.client import Checkpointer, Shard
from ckptd.client.dtypes import byte_view
from ckptd.client.health.heartbeat import Heartbeat
from ckptd.client.peer import PeerIndex, PeerServer
from ckptd.client.restore.prefetch import restore_command
from ckptd.client.staging.pool import StagingPool
from ckptd.errors import CheckpointNotFound, ChunkHashMismatch, NotCommitted, RestoreError
from ckptd.hashing import chunk_id, chunk_spans
from ckptd.repository import Repository
from tests.conftest import ServerProcess
from tests.integration.peer_fixtures import exported_shm, peer_server  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).parent))
from restore_peer import (  # noqa: E402
    CHUNK,
    TOKEN,
    held_steps,
    make_state,
    spawn,
    wait_held,
    wait_ready,
)

pytestmark = pytest.mark.timeout(180)


def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def ids_of(t: torch.Tensor, chunk: int = CHUNK) -> list[str]:
    view = byte_view(t.detach().contiguous())
    return [chunk_id(view[a:b]) for a, b in chunk_spans(len(view), chunk)]


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors(v)]
    return []


def distinct_bytes(state: Any, chunk: int = CHUNK) -> dict[str, int]:
    out = {}
    for t in tensors(state):
        view = byte_view(t.detach().contiguous())
        for a, b in chunk_spans(len(view), chunk):
            out[chunk_id(view[a:b])] = b - a
    return out


def target_like(state: Any) -> Any:
    """A target with the state's structure and zeroed tensors of the same shapes."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: target_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [target_like(v) for v in state]
    return state


# -- the local tier -------------------------------------------------------------------


def test_a_crashed_workers_pool_is_restored_from_shared_memory(
    tmp_path: Path, shm: Path
) -> None:
    url = file_url(tmp_path)
    proc = spawn(url, "crash", 0, 1, 5, seed=1, nbytes=1 << 20, stage_only=True)
    assert proc.wait(60) == -signal.SIGKILL
    expected = make_state(1, 1 << 20)
    pool = StagingPool.open_existing("crash", 0)
    assert pool is not None and pool.step == 5
    pool.close()

    target = target_like(expected)
    with Checkpointer(url, "crash", chunk_size=CHUNK) as ckpt:
        result = ckpt.restore(target)
    assert_bitwise(target, expected)
    assert result.step == 5 and result.problems == []
    total = sum(distinct_bytes(expected).values())
    assert result.bytes_from.get("local") == total and result.bytes_from.get("store", 0) == 0


def test_a_flipped_byte_in_a_dead_workers_pool_is_caught_where_it_lies(
    tmp_path: Path, shm: Path
) -> None:
    """The pool of a worker that died is consistent (its index names the committed
    ids) but one byte of one chunk went bad since: hashed where it lies, that
    chunk alone is taken from the store and reported stale; with the store not
    allowed the restore fails typed, naming it, and leaves the target as it was
    (atomic), or says it is partial (atomic=False)."""
    url = file_url(tmp_path)
    proc = spawn(url, "flip", 0, 1, 5, seed=2, nbytes=1 << 20, stage_only=True)
    assert proc.wait(60) == -signal.SIGKILL
    expected = make_state(2, 1 << 20)
    pool = StagingPool.open_existing("flip", 0)
    assert pool is not None and pool.consistent()
    entry = max(pool.index.entries, key=lambda e: e.end - e.start)
    bad = entry.chunks[1]  # (its second chunk: a flip inside the tensor, not at its start)
    with open(pool.directory / entry.segment, "r+b") as f:
        f.seek(entry.offset + CHUNK + 123)
        byte = f.read(1)
        f.seek(entry.offset + CHUNK + 123)
        f.write(bytes([byte[0] ^ 0x10]))
    pool.close()

    # (One checkpointer: closing one that found the pool's owner dead removes it.)
    with Checkpointer(url, "flip", chunk_size=CHUNK) as ckpt:
        for atomic in (True, False):
            target = target_like(expected)
            with pytest.raises(RestoreError) as info:
                ckpt.restore(target, tiers=("local",), atomic=atomic)
            assert info.value.detail["ids"] == [bad]
            assert [p["kind"] for p in info.value.detail["problems"]] == ["stale"]
            assert bool(info.value.detail.get("partial")) is not atomic
            if atomic:
                assert all(not t.any() for t in tensors(target)), "an atomic restore wrote"
        target = target_like(expected)
        result = ckpt.restore(target)
    assert_bitwise(target, expected)
    assert [(p.chunk, p.tier, p.kind) for p in result.problems] == [(bad, "local", "stale")]
    assert result.bytes_from["store"] == CHUNK
    assert result.bytes_from["local"] == sum(distinct_bytes(expected).values()) - CHUNK


def test_a_half_overwritten_pool_gives_only_its_matching_chunks(
    tmp_path: Path, shm: Path
) -> None:
    """Step 1 committed, then the worker staged step 2 (half the tensors changed)
    and died; then its pool was torn further (a stage that was copying: the
    generation is odd, some bytes are garbage). Restoring step 1 takes from the
    pool exactly the chunks whose bytes still verify, and the rest from the store."""
    url = file_url(tmp_path)
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(3 * CHUNK // 4 * 2 + 17, generator=g) for i in range(6)}
    step1 = snapshot(state)
    writer = Checkpointer(url, "torn", chunk_size=CHUNK)
    writer.save(1, state).wait(timeout=60)
    for i in (0, 2, 4):
        state[f"t{i}"].add_(1.0)
    state["t1"][5] = 42.0  # one chunk of t1 changes
    writer.save(2, state, meta={}).wait(timeout=60)
    pool_dir = writer.staging.directory

    # Exactly the step-1 chunks that step 2 did not change are still in the pool.
    now = {cid for t in state.values() for cid in ids_of(t)}
    want = distinct_bytes(step1)
    keep = sum(n for cid, n in want.items() if cid in now)
    assert 0 < keep < sum(want.values())
    target: dict[str, Any] = {}
    with Checkpointer(url, "torn", chunk_size=CHUNK) as reader:
        result = reader.restore(target, step=1)
    assert_bitwise(target, step1)
    assert result.bytes_from["local"] == keep
    assert result.bytes_from["store"] == sum(want.values()) - keep

    # Tear it: a stage that died while copying leaves an odd generation and some
    # bytes of the new state in place of the old.
    control = pool_dir / "control"
    data = bytearray(control.read_bytes())
    gen = struct.unpack_from("<Q", data, 8)[0]
    struct.pack_into("<Q", data, 8, gen + 1)
    control.write_bytes(bytes(data))
    seg = max((p for p in pool_dir.iterdir() if p.name.startswith("seg-")),
              key=lambda p: p.stat().st_size)
    with open(seg, "r+b") as f:
        f.seek(0)
        f.write(os.urandom(CHUNK // 2))  # the first chunk of whatever sits at offset 0
    target = {}
    with Checkpointer(url, "torn", chunk_size=CHUNK) as reader:
        torn = reader.restore(target, step=1)
    assert_bitwise(target, step1)
    assert torn.bytes_from["local"] <= keep
    assert torn.bytes_from["local"] + torn.bytes_from["store"] == sum(want.values())
    assert torn.problems and all(p.tier == "local" and p.kind == "stale"
                                 for p in torn.problems)
    writer.close()


def test_adopt_serves_only_verified_chunks_of_a_committed_step(
    srv: ServerProcess, shm: Path
) -> None:
    proc = spawn(srv.url, "adopt", 0, 1, 4, seed=2, nbytes=256 << 10, stage_only=True)
    assert proc.wait(60) == -signal.SIGKILL
    expected = make_state(2, 256 << 10)
    with Checkpointer(srv.url, "adopt", token=TOKEN, chunk_size=CHUNK,
                      heartbeat_interval=0.2) as ckpt:
        assert ckpt.adopt() == 4
        server = ckpt.peer_server
        assert server is not None and server.held_step == 4
        assert set(server.index.chunks) == set(distinct_bytes(expected))
        wait_held(srv, "adopt", [0], 4)
        target = target_like(expected)
        result = ckpt.restore(target)
        assert_bitwise(target, expected)
        assert result.bytes_from["local"] == sum(distinct_bytes(expected).values())


def test_a_pool_holding_part_of_a_step_is_not_served_as_holding_it(
    srv: ServerProcess, shm: Path
) -> None:
    """Step 4 committed, then the worker saved step 5 over its pool and died: the
    pool holds only the few step-4 chunks step 5 left alone (the constant ones).
    A holder of a step is a holder of its whole manifest to the server's planner:
    served, it would send a replacement rank's requests for every other chunk to a
    peer that answers 404. It is restored from, but neither adopted nor served."""
    for step, seed in ((4, 2), (5, 3)):
        proc = spawn(srv.url, "part", 0, 1, step, seed=seed, nbytes=256 << 10,
                     stage_only=True)
        assert proc.wait(60) == -signal.SIGKILL
    expected = make_state(2, 256 << 10)
    want = distinct_bytes(expected)
    with Checkpointer(srv.url, "part", token=TOKEN, chunk_size=CHUNK,
                      heartbeat_interval=0.2) as ckpt:
        assert ckpt.adopt(4) is None
        server = ckpt.peer_server
        assert server is not None and server.held_step is None
        target = target_like(expected)
        result = ckpt.restore(target, step=4)
        assert_bitwise(target, expected)
        assert 0 < result.bytes_from["local"] < sum(want.values())
        assert result.bytes_from["local"] + result.bytes_from["store"] == sum(want.values())
        assert server.held_step is None and not server.index.chunks
        ckpt.heartbeat.beat_now()
        assert held_steps(srv, "part").get(0) is None
        assert ckpt.adopt(5) == 5  # the step it holds whole is served
        wait_held(srv, "part", [0], 5)


# -- refusals ----------------------------------------------------------------------------


def test_restore_of_a_step_that_never_committed_is_refused(tmp_path: Path, shm: Path) -> None:
    url = file_url(tmp_path)
    with Checkpointer(url, "half", rank=0, world_size=2, chunk_size=CHUNK) as ckpt:
        assert ckpt.save(5, {"w": torch.ones(10)}).wait(timeout=30).state == "pending"
        target = {"w": torch.zeros(10)}
        with pytest.raises(NotCommitted):
            ckpt.restore(target, step=5)
        with pytest.raises(CheckpointNotFound):
            ckpt.restore(target)  # nothing committed at all
        with pytest.raises(CheckpointNotFound):
            ckpt.restore(target, step=6)
        assert ckpt.adopt() is None
    assert torch.equal(target["w"], torch.zeros(10))
    with pytest.raises(NotCommitted):
        restore_command(url, "half", 0, tmp_path / "dir", step=5, progress=False)


def test_a_chunk_no_source_has_is_a_typed_error_naming_it(tmp_path: Path, shm: Path) -> None:
    url = file_url(tmp_path)
    state = {"a": torch.arange(20000, dtype=torch.float32), "b": torch.ones(5)}
    with Checkpointer(url, "gone", chunk_size=CHUNK) as ckpt:
        ckpt.save(1, state).wait(timeout=30)
    victim = ids_of(state["a"])[1]
    (tmp_path / "store" / "chunks" / victim[:2] / victim).unlink()
    target = {"a": torch.zeros(20000), "b": torch.zeros(5)}
    with Checkpointer(url, "gone", chunk_size=CHUNK) as ckpt, pytest.raises(RestoreError) as info:
        ckpt.restore(target)
    assert info.value.detail["ids"] == [victim] and info.value.detail["entries"] == ["a"]
    assert info.value.detail["problems"][0]["kind"] == "missing"
    assert not target["a"].any() and not target["b"].any()  # untouched


# -- the cache tier and restore --to DIR ---------------------------------------------------


def test_restore_command_prefetches_a_rank_for_a_later_restore(
    srv: ServerProcess, tmp_path: Path, shm: Path
) -> None:
    expected = make_state(4, 512 << 10)
    with Checkpointer(srv.url, "pre", token=TOKEN, chunk_size=CHUNK) as ckpt:
        ckpt.save(9, expected).wait(timeout=60)
    cache = tmp_path / "cache"
    done = restore_command(srv.url, "pre", 0, cache, token=TOKEN, progress=False)
    total = sum(distinct_bytes(expected).values())
    assert (done.step, done.rank, done.bytes) == (9, 0, total)
    assert done.bytes_from["store"] == total and done.problems == []
    shown = io.StringIO()
    again = restore_command(srv.url, "pre", 0, cache, token=TOKEN,
                            console=Console(file=shown, width=120))  # with a progress bar
    assert again.bytes_from["cache"] == total and again.bytes_from["store"] == 0
    assert "pre step 9 rank 0" in shown.getvalue()

    # A local directory store: readable on its own ...
    target = target_like(expected)
    with Checkpointer(f"file://{cache}", "pre", chunk_size=CHUNK) as offline:
        assert offline.latest() == 9
        offline.restore(target)
    assert_bitwise(target, expected)
    # ... and a cache tier in front of the server; a damaged file there is caught.
    bad = next((cache / "chunks").glob("*/*"))
    bad.write_bytes(b"\0" * bad.stat().st_size)
    target = target_like(expected)
    with Checkpointer(srv.url, "pre", token=TOKEN, chunk_size=CHUNK, cache_dir=cache) as ckpt:
        result = ckpt.restore(target)
    assert_bitwise(target, expected)
    assert result.bytes_from["cache"] == total - bad.stat().st_size
    assert result.bytes_from["store"] == bad.stat().st_size
    assert [(p.tier, p.kind, p.chunk) for p in result.problems] == [("cache", "mismatch",
                                                                     bad.name)]


# -- peers ----------------------------------------------------------------------------------


def test_a_lost_node_restores_from_its_peers(srv: ServerProcess, shm: Path) -> None:
    expected = make_state(5, 1 << 20)
    procs = [spawn(srv.url, "peers", r, 3, 7, seed=5, nbytes=1 << 20) for r in (0, 1)]
    try:
        with Checkpointer(srv.url, "peers", rank=2, world_size=3, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:
            ckpt.save(7, expected).wait(timeout=60)  # the last of the three commits
        urls = [wait_ready(p) for p in procs]
        wait_held(srv, "peers", [0, 1], 7)
        target = target_like(expected)
        with Checkpointer(srv.url, "peers", rank=2, world_size=3, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:  # a new node: its pool is gone
            result = ckpt.restore(target)
        assert_bitwise(target, expected)
        total = sum(distinct_bytes(expected).values())
        assert result.bytes_from["peer"] == total and result.bytes_from.get("store", 0) == 0
        assert result.problems == []
        # Peers take the job's peer token (from the server's plan), not the server token.
        peer_token = httpx.get(f"{srv.url}/v1/jobs/peers/restore-plan", params={"rank": 2},
                               headers=srv.headers()).json()["peer_token"]
        assert httpx.get(f"{urls[0]}/v1/peer", headers=srv.headers()).status_code == 401
        served = [httpx.get(f"{u}/v1/peer", headers={"Authorization": f"Bearer {peer_token}"}
                            ).json()["stats"]["bytes_served"] for u in urls]
        assert sum(served) == total and all(s > 0 for s in served)  # spread across both
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_peer_killed_in_the_middle_of_a_restore(srv: ServerProcess, shm: Path) -> None:
    expected = make_state(6, 2 << 20)
    # Rank 0 dies (SIGKILL) once it has served 6 chunks of someone's restore.
    procs = [spawn(srv.url, "kill", r, 4, 3, seed=6, nbytes=2 << 20,
                   die_after=6 if r == 0 else 0) for r in (0, 1, 2)]
    try:
        with Checkpointer(srv.url, "kill", rank=3, world_size=4, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:
            ckpt.save(3, expected).wait(timeout=60)
        for p in procs:
            wait_ready(p)
        wait_held(srv, "kill", [0, 1, 2], 3)
        target = target_like(expected)
        with Checkpointer(srv.url, "kill", rank=3, world_size=4, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:
            result = ckpt.restore(target)
        assert procs[0].wait(30) == -signal.SIGKILL
        assert_bitwise(target, expected)
        total = sum(distinct_bytes(expected).values())
        assert sum(result.bytes_from.values()) == total
        assert result.bytes_from["peer"] > 0
        failed = [p for p in result.problems if p.kind == "failed"]
        assert failed and all(p.tier == "peer" for p in failed)
        assert len({p.source for p in failed}) == 1  # only the dead one
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_peer_that_serves_wrong_bytes_is_caught_and_skipped(
    srv: ServerProcess, shm: Path
) -> None:
    expected = make_state(8, 1 << 20)
    honest = spawn(srv.url, "liar", 2, 3, 2, seed=8, nbytes=1 << 20)
    evil = PeerServer(token=TOKEN).start()
    hb = Heartbeat(srv.url, "liar", 0, 3, token=TOKEN, peer_url=evil.url)
    try:
        for r in (0, 1):
            with Checkpointer(srv.url, "liar", rank=r, world_size=3, token=TOKEN,
                              chunk_size=CHUNK) as ckpt:
                ckpt.save(2, expected).wait(timeout=60)
        wait_ready(honest)
        # Rank 0's place is taken by a peer that answers every chunk with garbage.
        wrong = {cid: memoryview(os.urandom(n)) for cid, n in distinct_bytes(expected).items()}
        evil.publish(PeerIndex(step=2, chunks=wrong))
        hb.set_held_step(2, wake=False)
        reply = hb.beat_now()
        assert reply is not None
        evil.set_token(reply.peer_token)  # a liar inside the job holds its peer token
        hb.start()  # it keeps beating: alive in the plan however slow the machine is
        wait_held(srv, "liar", [0, 2], 2)
        target = target_like(expected)
        with Checkpointer(srv.url, "liar", rank=1, world_size=3, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:
            result = ckpt.restore(target)
        assert_bitwise(target, expected)
        lies = [p for p in result.problems if p.kind == "mismatch"]
        assert lies and all(p.source == evil.url and p.tier == "peer" for p in lies)
        # Caught on its first answers, then never asked again.
        assert evil.stats.served == len(lies) <= 8
        total = sum(distinct_bytes(expected).values())
        assert result.bytes_from["peer"] == total
    finally:
        hb.stop()
        evil.close()
        honest.kill()
        honest.wait()


# -- elastic ------------------------------------------------------------------------------


def global_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "rows": torch.randn(64, 96, generator=g),  # sharded on dim 0
        "cols": torch.randn(40, 128, generator=g).to(torch.bfloat16),  # sharded on dim 1
        "bias": torch.randn(300, generator=g),  # replicated
        "cube": torch.randn(8, 6, 20, generator=g).to(torch.float64),  # sharded on dim 1
    }


def shard_of(full: dict[str, torch.Tensor], rank: int, world: int) -> tuple[
    dict[str, Any], dict[str, Shard]
]:
    def rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
        n = t.shape[dim]
        a, b = n * rank // world, n * (rank + 1) // world
        offsets = [0] * t.dim()
        offsets[dim] = a
        return t.narrow(dim, a, b - a).contiguous().clone(), offsets

    state: dict[str, Any] = {"bias": full["bias"].clone(), "step": 11,
                             "rng": torch.tensor([rank, world])}
    shards = {}
    for name, dim in (("rows", 0), ("cols", 1), ("cube", 1)):
        state[name], offsets = rows(full[name], dim)
        shards[name] = Shard(list(full[name].shape), offsets)
    return state, shards


@pytest.mark.parametrize("transport", ["file", "http"])
def test_four_rank_save_restored_by_two_three_and_one_rank(
    transport: str, tmp_path: Path, shm: Path, request: pytest.FixtureRequest
) -> None:
    if transport == "http":
        server = request.getfixturevalue("srv")
        url, token = server.url, TOKEN
    else:
        url, token = file_url(tmp_path), None
    full = global_state(9)
    for r in range(4):
        state, shards = shard_of(full, r, 4)
        with Checkpointer(url, "elastic", rank=r, world_size=4, token=token,
                          chunk_size=4096) as ckpt:
            ckpt.save(11, state, shards=shards, local=["rng"]).wait(timeout=60)
    for world in (2, 3):
        for r in range(world):
            expected, shards = shard_of(full, r, world)
            target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                      for k, v in expected.items()}
            with Checkpointer(url, "elastic", rank=r, world_size=world, token=token,
                              chunk_size=4096) as ckpt:
                result = ckpt.restore(target, shards=shards)
            assert result.elastic and result.world_size == 4
            for name in ("rows", "cols", "cube", "bias"):
                assert_bitwise(target[name], expected[name], name)
            assert target["step"] == 11
            # rank-local state is never resharded: a rank's own, or rank 0's
            assert target["rng"].tolist() == [r, 4]
            # Only the chunks that overlap this rank's slices were fetched.
            assert sum(result.bytes_from.values()) < sum(
                t.numel() * t.element_size() for t in full.values())
    # One rank takes the whole of every global tensor.
    target = {}
    with Checkpointer(url, "elastic", rank=0, world_size=1, token=token) as ckpt:
        ckpt.restore(target)
    for name, t in full.items():
        assert_bitwise(target[name], t, name)


def test_elastic_restore_with_a_chunk_size_that_splits_elements(
    tmp_path: Path, shm: Path
) -> None:
    # 4097-byte chunks cut float32 and float64 elements in two: the slices cut
    # from them must still land aligned (a chunk size need not be a multiple of
    # the element size).
    url = file_url(tmp_path)
    full = global_state(12)
    for r in range(2):
        state, shards = shard_of(full, r, 2)
        with Checkpointer(url, "odd", rank=r, world_size=2, chunk_size=4097) as ckpt:
            ckpt.save(1, state, shards=shards, local=["rng"]).wait(timeout=60)
    for world, r in ((3, 0), (3, 1), (3, 2), (1, 0)):
        expected, shards = shard_of(full, r, world)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                  for k, v in expected.items()}
        with Checkpointer(url, "odd", rank=r, world_size=world) as ckpt:
            result = ckpt.restore(target, shards=shards)
        assert result.elastic
        for name in ("rows", "cols", "cube", "bias"):
            assert_bitwise(target[name], expected[name], name)


def test_the_same_world_restores_its_own_shard_without_reading_other_manifests(
    tmp_path: Path, shm: Path
) -> None:
    url = file_url(tmp_path)
    full = global_state(10)
    for r in range(2):
        state, shards = shard_of(full, r, 2)
        with Checkpointer(url, "same", rank=r, world_size=2, chunk_size=4096) as ckpt:
            ckpt.save(1, state, shards=shards, local=["rng"]).wait(timeout=60)
    expected, shards = shard_of(full, 1, 2)
    target: dict[str, Any] = {}
    with Checkpointer(url, "same", rank=1, world_size=2) as ckpt:
        result = ckpt.restore(target)
    assert not result.elastic
    assert_bitwise(target, expected)


def test_a_tensor_saved_sharded_by_another_world_needs_its_shard(
    tmp_path: Path, shm: Path
) -> None:
    url = file_url(tmp_path)
    full = global_state(11)
    for r in range(2):
        state, shards = shard_of(full, r, 2)
        with Checkpointer(url, "ambig", rank=r, world_size=2, chunk_size=4096) as ckpt:
            ckpt.save(1, state, shards=shards, local=["rng"]).wait(timeout=60)
    target = {"rows": torch.zeros(16, 96)}
    with Checkpointer(url, "ambig", rank=0, world_size=4) as ckpt, pytest.raises(
        RestoreError, match="pass its Shard"
    ):
        ckpt.restore(target)
    assert not target["rows"].any()


def test_a_corrupt_store_chunk_with_no_other_source_is_a_hash_mismatch(
    tmp_path: Path, shm: Path
) -> None:
    url = file_url(tmp_path)
    with Checkpointer(url, "rot", chunk_size=CHUNK) as ckpt:
        ckpt.save(1, {"w": torch.arange(10000, dtype=torch.float32)}).wait(timeout=30)
    victim = ids_of(torch.arange(10000, dtype=torch.float32))[0]
    path = tmp_path / "store" / "chunks" / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    with Checkpointer(url, "rot") as ckpt, pytest.raises(ChunkHashMismatch) as info:
        ckpt.restore({})
    assert info.value.detail["id"] == victim and info.value.detail["entries"] == ["w"]


def test_a_store_on_this_host_is_read_in_place_and_still_verified(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # file://: chunk files are mapped and hashed where they lie (no read into fresh
    # memory through the repository), and a damaged one is still caught.
    url = file_url(tmp_path)
    state = {"w": torch.arange(30000, dtype=torch.float32), "b": torch.ones(5)}
    with Checkpointer(url, "mapped", chunk_size=CHUNK) as ckpt:
        ckpt.save(1, state).wait(timeout=30)
    reads: list[str] = []
    original = Repository.get_chunk

    async def counted(self: Repository, cid: str, *, verify: bool = True) -> bytes:
        reads.append(cid)
        return await original(self, cid, verify=verify)

    monkeypatch.setattr(Repository, "get_chunk", counted)
    target = {"w": torch.zeros(30000), "b": torch.zeros(5)}
    with Checkpointer(url, "mapped") as ckpt:
        result = ckpt.restore(target, tiers=["store"])
    assert_bitwise(target, state)
    assert result.bytes_from["store"] == sum(distinct_bytes(state).values())
    assert reads == []
    victim = ids_of(state["w"])[1]
    path = tmp_path / "store" / "chunks" / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[3] ^= 0x10
    path.write_bytes(bytes(data))
    target = {"w": torch.zeros(30000), "b": torch.zeros(5)}
    with Checkpointer(url, "mapped") as ckpt, pytest.raises(ChunkHashMismatch) as info:
        ckpt.restore(target, tiers=["store"])
    assert info.value.detail["id"] == victim
    assert not target["w"].any()  # atomic: nothing landed


def test_atomic_false_lands_chunks_in_the_target_and_says_when_that_left_it_partial(
    tmp_path: Path, shm: Path
) -> None:
    url = file_url(tmp_path)
    state = {"a": torch.arange(20000, dtype=torch.float32), "b": torch.arange(9000.0) * 3}
    with Checkpointer(url, "inplace", chunk_size=CHUNK) as ckpt:
        ckpt.save(1, state).wait(timeout=30)
    target = {"a": torch.zeros(20000), "b": torch.zeros(9000)}
    a = target["a"]
    with Checkpointer(url, "inplace") as ckpt:
        result = ckpt.restore(target, atomic=False)
    assert target["a"] is a  # filled in place
    assert_bitwise(target, state)
    assert result.bytes_from["store"] == sum(distinct_bytes(state).values())

    victim = ids_of(state["b"])[-1]
    (tmp_path / "store" / "chunks" / victim[:2] / victim).unlink()
    target = {"a": torch.zeros(20000), "b": torch.zeros(9000)}
    with Checkpointer(url, "inplace") as ckpt, pytest.raises(RestoreError) as info:
        ckpt.restore(target, atomic=False)
    assert info.value.detail["partial"] is True and info.value.detail["ids"] == [victim]
    assert "partly restored" in str(info.value)
    assert torch.equal(target["a"], state["a"])  # what verified did land
