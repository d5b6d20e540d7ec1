"""The in-process client over a local directory store (``file://``, no server)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_client_common import (
    assert_bitwise,
    assert_trainer_equals,
    fresh_target,
    make_trainer,
    snapshot,
    training_state,
)

from ckptd.client import Checkpointer, LocalTransport, SaveResult, Shard, open_transport
from ckptd.client.dtypes import byte_view
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    Conflict,
    InvalidRequest,
    RestoreError,
    SnapshotSkipped,
    Timeout,
    UnsupportedValue,
)
from ckptd.hashing import chunk_id, chunk_spans

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def url(store: Path) -> str:
    return f"file://{store}"


def chunk_ids(tensor: torch.Tensor, chunk_size: int) -> list[str]:
    view = memoryview(byte_view(tensor.contiguous()))
    return [chunk_id(view[a:b]) for a, b in chunk_spans(len(view), chunk_size)]


def chunk_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "chunks").rglob("*") if p.is_file())


def test_realistic_state_round_trips_bitwise_into_a_fresh_trainer(store: Path) -> None:
    trainer = make_trainer(seed=0, steps=3)
    state = training_state(trainer)
    expected = snapshot(state)
    with Checkpointer(url(store), "llm", chunk_size=16384) as ckpt:
        handle = ckpt.save(3, state, meta={"loss": 0.125})
        result = handle.wait(timeout=60)
        assert handle.done() and not handle.skipped and handle.step == 3
        assert isinstance(result, SaveResult)
        assert (result.step, result.state) == (3, "committed")
        assert result.bytes_staged == sum(
            t.numel() * t.element_size() for t in _tensors(expected)
        )
        assert result.bytes_sent + result.bytes_deduplicated == result.bytes_staged
        assert 0 < result.chunks_sent <= result.chunks_total
        assert result.stage_seconds <= result.total_seconds
        assert ckpt.latest() == 3

    fresh, target = fresh_target(seed=123)
    assert fresh.optim.state_dict()["state"] == {}  # nothing to copy into: created
    model_tensors = dict(target["model"])
    with Checkpointer(url(store), "llm") as ckpt:
        restored = ckpt.restore(target)
    assert restored.step == 3
    assert restored.bytes_restored == result.bytes_staged
    assert restored.chunks == result.chunks_total
    assert restored.bytes_from["store"] > 0
    # the model's state dict was filled in place: its tensors are the parameters
    for name, t in target["model"].items():
        assert t is model_tensors[name]
    fresh.load(target)
    assert_trainer_equals(fresh, expected)
    for key in ("step", "loss", "best", "last_bad", "tag", "rng", "flags"):
        assert_bitwise(target[key], expected[key], key)
    assert fresh.model.linear1.weight.dtype == torch.bfloat16


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def test_changing_tensors_after_save_returns_does_not_change_the_snapshot(store: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(4, 1 << 20, generator=g), "small": torch.arange(10),
             "bf": torch.randn(1000, generator=g).to(torch.bfloat16)}
    expected = snapshot(state)
    with Checkpointer(url(store), "mut", chunk_size=1 << 20) as ckpt:
        handle = ckpt.save(1, state)
        for t in state.values():  # the training loop goes on at once
            t.add_(1) if t.dtype != torch.bool else t.logical_not_()
        state["big"].zero_()
        handle.wait(timeout=60)
        target: dict[str, Any] = {}
        ckpt.restore(target)
    assert_bitwise(target, expected)


def test_staging_buffers_are_reused_between_saves(store: Path) -> None:
    state = {"w": torch.ones(1000), "b": torch.zeros(10)}
    with Checkpointer(url(store), "reuse") as ckpt:
        ckpt.save(1, state).wait(timeout=30)
        first = dict(ckpt.staging._buffers)
        state["w"].add_(1)
        ckpt.save(2, state).wait(timeout=30)
        second = dict(ckpt.staging._buffers)
        assert {k: v.data_ptr() for k, v in first.items()} == {
            k: v.data_ptr() for k, v in second.items()
        }
        target: dict[str, Any] = {}
        ckpt.restore(target, step=1)
        assert torch.equal(target["w"], torch.ones(1000))
        ckpt.restore(target, step=2)
        assert torch.equal(target["w"], torch.full((1000,), 2.0))


def test_unchanged_regions_are_not_sent_again(store: Path) -> None:
    cs = 4096
    t = torch.zeros(10 * cs // 4 + 7)  # 10 full chunks and a short one
    with Checkpointer(url(store), "incr", chunk_size=cs) as ckpt:
        first = ckpt.save(1, {"t": t}).wait(timeout=30)
        assert first.chunks_total == 2  # nine equal zero chunks dedup within the snapshot
        t[cs // 4 * 3 + 5] = 1.0  # one element in chunk 3
        second = ckpt.save(2, {"t": t}).wait(timeout=30)
    assert (second.chunks_total, second.chunks_sent, second.bytes_sent) == (3, 1, cs)
    assert second.bytes_deduplicated == t.numel() * 4 - cs


def test_restore_without_a_checkpoint_raises_not_found(store: Path) -> None:
    with Checkpointer(url(store), "nothing") as ckpt:
        assert ckpt.latest() is None
        target = {"w": torch.ones(2)}
        with pytest.raises(CheckpointNotFound):
            ckpt.restore(target)
        ckpt.save(1, {"w": torch.zeros(2)}).wait(timeout=30)
        with pytest.raises(CheckpointNotFound):
            ckpt.restore(target, step=7)
    assert torch.equal(target["w"], torch.ones(2))


def test_corrupt_chunk_raises_and_leaves_the_target_unchanged(store: Path) -> None:
    trainer = make_trainer(seed=0, steps=3)
    with Checkpointer(url(store), "rot", chunk_size=8192) as ckpt:
        ckpt.save(3, training_state(trainer)).wait(timeout=60)
    files = chunk_files(store)
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))

    fresh, target = fresh_target(seed=5)
    before = snapshot(target)
    with Checkpointer(url(store), "rot") as ckpt, pytest.raises(ChunkHashMismatch) as info:
        ckpt.restore(target)
    assert info.value.detail["id"] == victim.name
    assert info.value.detail["entries"]
    assert_bitwise(target, before)
    assert fresh.optim.state_dict()["state"] == {}

    async def verify() -> dict[str, Any]:
        transport = open_transport(url(store))
        try:
            return await transport.verify("rot")
        finally:
            await transport.close()

    report = asyncio.run(verify())
    assert report["bad_chunks"] == [victim.name] and report["ok"] is False


def test_a_target_with_other_shapes_is_refused_before_any_change(store: Path) -> None:
    with Checkpointer(url(store), "shape") as ckpt:
        ckpt.save(1, {"a": torch.ones(2, 3), "b": torch.ones(4), "n": 5}).wait(timeout=30)
        target: dict[str, Any] = {"a": torch.zeros(3, 2), "b": torch.zeros(4), "n": 0}
        with pytest.raises(RestoreError) as info:
            ckpt.restore(target)
    assert info.value.detail["entries"] == [
        "'a': target torch.float32[3, 2], checkpoint torch.float32[2, 3]"
    ]
    assert torch.equal(target["b"], torch.zeros(4)) and target["n"] == 0


def test_unsupported_state_is_refused_by_save_itself(store: Path) -> None:
    with Checkpointer(url(store), "bad") as ckpt:
        with pytest.raises(UnsupportedValue, match=r"state\['opt'\]\['x'\]"):
            ckpt.save(1, {"opt": {"x": object()}})
        with pytest.raises(UnsupportedValue):
            ckpt.save(1, {"w": torch.ones(1)}, meta={"not json": {1, 2}})
        with pytest.raises(InvalidRequest):
            ckpt.save(1, {"w": torch.ones(1)}, local=["nope"])
        assert ckpt.latest() is None
        ckpt.save(1, {"w": torch.ones(1)}).wait(timeout=30)  # training goes on
        assert ckpt.latest() == 1


def test_background_errors_surface_typed_on_wait(store: Path) -> None:
    with Checkpointer(url(store), "again") as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait(timeout=30)
        # Same step, other bytes: refused before anything is sent (the checkpointer
        # knows its own manifest of the step; the server would say AlreadyCommitted).
        handle = ckpt.save(1, {"w": torch.zeros(3)})
        with pytest.raises(Conflict):
            handle.wait(timeout=30)
        assert handle.done()
        assert ckpt.save(2, {"w": torch.zeros(3)}).wait(timeout=30).state == "committed"
        target: dict[str, Any] = {}
        ckpt.restore(target, step=1)
        assert torch.equal(target["w"], torch.ones(3))


class Replica:
    """Another data-parallel replica, driven by the test: it claims chunk ids in the
    same repository and sends them when told to."""

    def __init__(self, ckpt: Checkpointer) -> None:
        transport = ckpt.transport
        assert isinstance(transport, LocalTransport)
        self.repository = transport.repository

    def claim(self, ids: list[str], lease: float = 30.0) -> list[str]:
        answer = asyncio.run(self.repository.missing_chunks(ids, "job/other-replica", lease))
        return answer.missing

    def send(self, tensor: torch.Tensor, chunk_size: int) -> None:
        view = memoryview(byte_view(tensor))
        for a, b in chunk_spans(len(view), chunk_size):
            asyncio.run(self.repository.put_chunk(chunk_id(view[a:b]), view[a:b]))


def test_on_busy_skip_and_waiting_for_chunks_another_replica_sends(store: Path) -> None:
    cs = 4096
    w = torch.arange(3000, dtype=torch.float32)
    with Checkpointer(url(store), "skip", chunk_size=cs, on_busy="skip") as ckpt:
        other = Replica(ckpt)
        ids = chunk_ids(w, cs)
        assert other.claim(ids) == ids
        first = ckpt.save(1, {"w": w})  # its chunks are in flight elsewhere: it waits
        time.sleep(0.3)
        assert not first.done()
        second = ckpt.save(2, {"w": w + 1})
        assert second.skipped and second.done() and second.step == 2
        with pytest.raises(SnapshotSkipped):
            second.wait()
        with pytest.raises(Timeout):
            first.wait(timeout=0.1)
        other.send(w, cs)
        result = first.wait(timeout=30)
    assert result.state == "committed"
    assert (result.chunks_sent, result.bytes_sent) == (0, 0)  # the other replica sent them
    assert result.bytes_deduplicated == w.numel() * 4


def test_a_lapsed_claim_comes_back_to_us(store: Path) -> None:
    cs = 4096
    w = torch.arange(3000, dtype=torch.float32)
    with Checkpointer(url(store), "lapse", chunk_size=cs) as ckpt:
        Replica(ckpt).claim(chunk_ids(w, cs), lease=0.5)  # and never sends
        result = ckpt.save(1, {"w": w}).wait(timeout=30)
    assert result.bytes_sent == w.numel() * 4 and result.state == "committed"


def test_on_busy_wait_waits_for_the_snapshot_in_flight(store: Path) -> None:
    cs = 4096
    w = torch.arange(3000, dtype=torch.float32)
    with Checkpointer(url(store), "busy", chunk_size=cs, timeout=0.3) as ckpt:
        other = Replica(ckpt)
        other.claim(chunk_ids(w, cs))
        first = ckpt.save(1, {"w": w})
        with pytest.raises(Timeout):  # bounded by the checkpointer's timeout
            ckpt.save(2, {"w": w + 1})
        timer = threading.Timer(0.3, other.send, (w, cs))
        timer.start()
        ckpt.timeout = 30
        second = ckpt.save(2, {"w": w + 1})  # blocks until step 1 is done
        assert first.done()
        timer.join()
        assert first.wait().state == "committed"
        assert second.wait(timeout=30).state == "committed"
        assert ckpt.latest() == 2


def test_sharded_and_local_entries_across_two_ranks(store: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ckpts = [Checkpointer(url(store), "tp", rank=r, world_size=2) for r in range(2)]
    try:
        handles = []
        for r, ckpt in enumerate(ckpts):
            state = {"w": full[3 * r : 3 * r + 3].clone(), "bias": torch.ones(4),
                     "rng": torch.tensor([r])}
            handles.append(ckpt.save(5, state, shards={"w": Shard((6, 4), (3 * r, 0))},
                                     local=["rng"]))
        states = [h.wait(timeout=30).state for h in handles]
        assert "committed" in states  # the rank that completes the step commits it
        assert all(ckpt.latest() == 5 for ckpt in ckpts)
        for r, ckpt in enumerate(ckpts):
            target: dict[str, Any] = {"w": torch.zeros(3, 4)}
            ckpt.restore(target)
            assert torch.equal(target["w"], full[3 * r : 3 * r + 3])
            assert torch.equal(target["rng"], torch.tensor([r]))
            assert torch.equal(target["bias"], torch.ones(4))

        async def entries() -> dict[str, tuple[str, list[int], list[int]]]:
            manifest = await ckpts[1].transport.read_manifest("tp", 5, 1)
            return {e.name: (e.placement, e.global_shape, e.offsets) for e in manifest.entries}

        assert ckpts[1]._call(entries(), 30) == {
            "w": ("sharded", [6, 4], [3, 0]),
            "bias": ("replicated", [4], [0]),
            "rng": ("local", [1], [0]),
        }
    finally:
        for ckpt in ckpts:
            ckpt.close()
    # One rank now: the whole tensor, and rank 1's rank-local entry is said to be
    # restored by no rank (a multi-node probe's replacement with fewer ranks: no word).
    with caplog.at_level(logging.WARNING, logger="ckptd.client"), \
            Checkpointer(url(store), "tp", rank=0, world_size=1) as alone:
        target = {"w": torch.zeros(6, 4)}
        alone.restore(target, shards={"w": Shard((6, 4), (0, 0))})
        assert torch.equal(target["w"], full)
    said = [r.getMessage() for r in caplog.records if "restored by no rank" in r.getMessage()]
    assert len(said) == 1 and "saved by 2 ranks and this launch has 1" in said[0], said
    assert "entries of rank 1 " in said[0], said


def test_listing_through_the_transport(store: Path) -> None:
    with Checkpointer(url(store), "ls-a") as a, Checkpointer(url(store), "ls-b") as b:
        a.save(1, {"w": torch.ones(4)}).wait(timeout=30)
        a.save(2, {"w": torch.ones(4)}).wait(timeout=30)
        b.save(7, {"w": torch.ones(4)}).wait(timeout=30)

    async def listing() -> tuple[Any, Any, Any]:
        transport = open_transport(url(store))
        try:
            return (await transport.list_jobs(), await transport.list_steps("ls-a"),
                    await transport.verify("ls-a", 2))
        finally:
            await transport.close()

    jobs, steps, report = asyncio.run(listing())
    assert jobs == [{"job": "ls-a", "latest": 2}, {"job": "ls-b", "latest": 7}]
    assert [(s.step, s.committed, s.is_latest, s.logical_bytes) for s in steps] == [
        (1, True, False, 16), (2, True, True, 16)
    ]
    assert report["ok"] is True and report["steps"] == [2] and report["chunks_checked"] == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        Checkpointer("ftp://x/y", "j")
    with pytest.raises(InvalidRequest, match=r"rank must be an int, not str '0'"):
        Checkpointer("file:///tmp/x", "j", rank="0")
    # (found by a probe: OverflowError, ValueError and NotADirectoryError from inside)
    with pytest.raises(InvalidRequest, match="peer_port must be a port"):
        Checkpointer("file:///tmp/x", "j", peer_port=99999)
    with pytest.raises(InvalidRequest, match="chunk_size is a whole number of bytes"):
        Checkpointer("file:///tmp/x", "j", chunk_size="4MB")
    with pytest.raises(InvalidRequest, match="is a file, not a directory"):
        Checkpointer("file:///tmp/x", "j", shm_dir=__file__)
    for bad in ("http://127.0.0.1:notaport", "http://127.0.0.1:99999", "http://[::1",
                "http://256.1.1.1:80", "http://127.0.0.1:0"):
        with pytest.raises(InvalidRequest, match="URL"):
            Checkpointer(bad, "j")
    with pytest.raises(InvalidRequest):
        Checkpointer("file:///tmp/x", "bad job name")
    with pytest.raises(InvalidRequest):
        Checkpointer("file:///tmp/x", "j", rank=2, world_size=2)
    with pytest.raises(InvalidRequest):
        Checkpointer("file:///tmp/x", "j", chunk_size=10)
    with pytest.raises(InvalidRequest):
        Shard((4, 4), (0,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip_through_host_staging(store: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {"w": torch.randn(257, 33, device="cuda", generator=g).to(torch.bfloat16),
             "step": torch.tensor(4.0, device="cuda")}
    expected = {k: v.cpu() for k, v in state.items()}
    with Checkpointer(url(store), "gpu", chunk_size=4096) as ckpt:
        handle = ckpt.save(1, state)
        handle.staged()
        state["w"].zero_()
        handle.wait(timeout=60)
        target = {"w": torch.empty(257, 33, device="cuda", dtype=torch.bfloat16)}
        w = target["w"]
        ckpt.restore(target)
    assert target["w"] is w and target["w"].is_cuda
    assert_bitwise({k: v.cpu() for k, v in target.items()}, expected)


def test_restore_arguments_of_the_wrong_kind_are_refused_saying_what_to_pass(
        store: Path, shm: Path) -> None:
    """(Found by a probe: tiers="store" was refused as "not ['e', 'o', 'r', 's', 't']",
    shards={"w": 3} was an AttributeError from inside the layout.)"""
    with Checkpointer(url(store), "kinds", shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait(timeout=30)
        target = {"w": torch.zeros(4)}
        with pytest.raises(InvalidRequest, match=r"tiers=\['store'\]"):
            ckpt.restore(target, tiers="store")
        with pytest.raises(InvalidRequest, match=r"Shard\(global_shape, offsets\)"):
            ckpt.restore(target, shards={"w": 3})
        for bad in (-1, 0):
            with pytest.raises(InvalidRequest, match="seconds above 0"):
                ckpt.restore(target, timeout=bad)
        assert not target["w"].any()
