"""The in-process client against a real ``ckptd serve`` process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict
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

from ckptd.client import Checkpointer, HttpTransport, open_transport
from ckptd.client.dtypes import byte_view
from ckptd.client.save.flatten import flatten
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkNotFound,
    Unauthorized,
    Unavailable,
)
from ckptd.hashing import chunk_id, chunk_spans

pytestmark = pytest.mark.timeout(180)


def unique_chunks(state: dict[str, Any], chunk_size: int) -> dict[str, int]:
    """Chunk id -> size over every tensor of a state: what one replica must send."""
    out: dict[str, int] = {}
    for _, t in flatten(state).tensors:
        view = memoryview(byte_view(t.detach().contiguous()))
        for a, b in chunk_spans(len(view), chunk_size):
            out[chunk_id(view[a:b])] = b - a
    return out


def test_realistic_state_round_trips_bitwise_over_http(server: Any) -> None:
    trainer = make_trainer(seed=0, steps=3)
    state = training_state(trainer)
    expected = snapshot(state)
    with Checkpointer(server.url, "llm", chunk_size=16384) as ckpt:
        assert isinstance(ckpt.transport, HttpTransport)
        result = ckpt.save(3, state).wait(timeout=60)
        assert result.state == "committed"
        assert result.bytes_sent == sum(unique_chunks(expected, 16384).values())
        assert ckpt.latest() == 3
        # a second save of the same state sends nothing
        again = ckpt.save(4, state).wait(timeout=60)
        assert (again.bytes_sent, again.chunks_sent) == (0, 0)
        assert again.bytes_deduplicated == again.bytes_staged

    fresh, target = fresh_target(seed=99)
    with Checkpointer(server.url, "llm") as ckpt:
        restored = ckpt.restore(target, step=3)
    assert restored.step == 3 and restored.bytes_restored == result.bytes_staged
    fresh.load(target)
    assert_trainer_equals(fresh, expected)
    for key in ("step", "loss", "best", "last_bad", "tag", "rng", "flags"):
        assert_bitwise(target[key], expected[key], key)


def test_two_replicas_commit_once_and_send_each_chunk_once(server: Any) -> None:
    trainer = make_trainer(seed=1, steps=2)
    cs = 8192
    ckpts = [
        Checkpointer(server.url, "dp", rank=r, world_size=2, chunk_size=cs) for r in range(2)
    ]
    try:
        states = [trainer.state(), snapshot(trainer.state())]  # identical replicas
        one_replica = unique_chunks(states[0], cs)
        start = threading.Barrier(2)
        handles: list[Any] = [None, None]

        def save(rank: int) -> None:
            start.wait()
            handles[rank] = ckpts[rank].save(10, states[rank])

        threads = [threading.Thread(target=save, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [h.wait(timeout=60) for h in handles]
        assert "committed" in {r.state for r in results}
        assert all(c.latest() == 10 for c in ckpts)
        assert sum(r.bytes_sent for r in results) == sum(one_replica.values())
        assert sum(r.chunks_sent for r in results) == len(one_replica)
        assert all(r.chunks_total == len(one_replica) for r in results)

        async def steps() -> Any:
            transport = open_transport(server.url)
            try:
                return await transport.list_steps("dp")
            finally:
                await transport.close()

        (info,) = asyncio.run(steps())
        assert (info.step, info.committed, info.world_size, info.ranks_present) == (10, True, 2, 2)

        for r, ckpt in enumerate(ckpts):
            fresh, target = fresh_target(seed=50 + r)
            ckpt.restore(target)
            fresh.load(target)
            assert_trainer_equals(fresh, states[1])
    finally:
        for ckpt in ckpts:
            ckpt.close()


def test_a_server_that_is_gone_gives_unavailable_in_bounded_time(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "1")
    monkeypatch.setenv("CKPTD_RETRY_BACKOFF", "0.05")
    state = {"w": torch.randn(1000), "step": 1}
    with Checkpointer(server.url, "gone", timeout=30) as ckpt:
        ckpt.save(1, state).wait(timeout=30)
        server.stop()
        t0 = time.monotonic()
        handle = ckpt.save(2, state)
        with pytest.raises(Unavailable):
            handle.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        with pytest.raises(Unavailable):
            ckpt.latest()
        with pytest.raises(Unavailable):
            ckpt.restore({})
        server.start()  # same store and port: the training loop carries on
        assert ckpt.save(3, state).wait(timeout=30).state == "committed"
        assert ckpt.latest() == 3


# The two tests with a token share a server (``shared_token_server``,
# tests/integration/conftest.py), each with a job of its own; the others each have
# one of their own (``server``): they count the bytes a save sends (none of its
# chunks stored before), list the store's jobs, damage its largest chunk file, or
# stop and start it.


def test_token_round_trip(shared_token_server: Any) -> None:
    state = {"w": torch.arange(100, dtype=torch.int64), "lr": 0.5}
    with Checkpointer(shared_token_server.url, "secret", token=shared_token_server.token) as ckpt:
        assert ckpt.save(1, state).wait(timeout=30).state == "committed"
        target: dict[str, Any] = {}
        ckpt.restore(target)
    assert_bitwise(target, state)
    for token in (None, "wrong-token"):
        # Said at construction (tests/integration/test_fail_fast.py), before any save.
        with pytest.raises(Unauthorized):
            Checkpointer(shared_token_server.url, "secret", token=token)


def test_corrupt_chunk_in_the_servers_store_is_caught(server: Any) -> None:
    with Checkpointer(server.url, "rot", chunk_size=4096) as ckpt:
        ckpt.save(1, {"w": torch.randn(5000), "b": torch.ones(3)}).wait(timeout=30)
        victim = max((p for p in (server.store / "chunks").rglob("*") if p.is_file()),
                     key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[7] ^= 0x01
        victim.write_bytes(bytes(data))
        target = {"w": torch.zeros(5000), "b": torch.zeros(3)}
        with pytest.raises(ChunkHashMismatch):
            ckpt.restore(target, tiers=["store"])
        assert not target["w"].any() and not target["b"].any()
        # This rank's pool still holds the step: the restore takes it from there.
        result = ckpt.restore(target)
        assert result.bytes_from["local"] > 0 and result.bytes_from.get("store", 0) == 0
        assert target["w"].any()


def test_no_checkpoint_over_http(server: Any) -> None:
    with Checkpointer(server.url, "empty") as ckpt:
        assert ckpt.latest() is None
        with pytest.raises(CheckpointNotFound):
            ckpt.restore({})


def test_http_and_local_transports_answer_alike(server: Any) -> None:
    with Checkpointer(server.url, "cli", chunk_size=4096) as ckpt:
        ckpt.save(1, {"w": torch.ones(3000)}).wait(timeout=30)
        ckpt.save(2, {"w": torch.ones(3000) * 2}).wait(timeout=30)

    async def answers(url: str) -> tuple[Any, ...]:
        transport = open_transport(url)
        try:
            steps = [asdict(s) for s in await transport.list_steps("cli")]
            return (await transport.list_jobs(), steps, await transport.verify("cli"),
                    await transport.verify("cli", 1), await transport.latest("cli"),
                    await transport.latest("none"))
        finally:
            await transport.close()

    over_http = asyncio.run(answers(server.url))
    in_process = asyncio.run(answers(f"file://{server.store}"))
    assert over_http == in_process
    jobs, steps, report, report1, latest, none = over_http
    assert jobs == [{"job": "cli", "latest": 2}]
    assert [s["step"] for s in steps] == [1, 2] and steps[1]["is_latest"]
    assert report["ok"] and report["steps"] == [1, 2] and report1["steps"] == [1]
    assert (latest, none) == (2, None)


def test_chunks_are_read_straight_into_a_buffer_from_their_home_replica(
    shared_token_server: Any,
) -> None:
    """The store tier's direct read (the transport's ``chunk_reader``) gets the same
    bytes as ``get_chunk``, with the token, into the caller's buffer; a chunk the
    store lacks is an error the caller then takes the transport's way."""
    state = {"w": torch.arange(50_000, dtype=torch.float32)}
    with Checkpointer(shared_token_server.url, "direct", token=shared_token_server.token) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
    view = byte_view(state["w"])
    cid = chunk_id(view)  # one chunk: 200,000 bytes < the default chunk size

    async def run() -> None:
        transport = open_transport(shared_token_server.url, shared_token_server.token, job="direct")
        try:
            read = transport.chunk_reader()
            assert read is not None
            dest = memoryview(bytearray(len(view)))
            await asyncio.to_thread(read, cid, dest)
            assert bytes(dest) == bytes(view) == await transport.get_chunk(cid)
            with pytest.raises(ChunkNotFound):
                await asyncio.to_thread(read, "0" * 64, memoryview(bytearray(len(view))))
        finally:
            await transport.close()
        tls = open_transport("https://127.0.0.1:1", "t")
        try:
            assert tls.chunk_reader() is None  # TLS replicas: through httpx only
        finally:
            await tls.close()

    asyncio.run(run())
