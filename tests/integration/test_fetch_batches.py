"""One ``ChunkFetcher`` fetching several batches, as DCP's ``Reader`` does for a load
(``_fetch_batch``: ``locate_all`` then ``deliver`` per batch, one fetcher for all):
what one batch recorded about its destinations must not feed a later batch's
copies (found by review). The sources are real: a cache directory of chunk files
(in place) and a ``PeerServer`` on loopback (fetched)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import blake3
import pytest

from ckptd.client.peer import PeerClient, PeerIndex, PeerServer
from ckptd.client.restore.fetch import ChunkFetcher, WantedChunks, deliver
from ckptd.client.restore.sources import DirectoryCacheSource, PeerSource
from ckptd.format import chunk_key

pytestmark = pytest.mark.timeout(60)

TOKEN = "peer-token"


def _batch(fetcher: ChunkFetcher, wanted: WantedChunks) -> None:
    async def run() -> None:
        found = await fetcher.locate_all(wanted, atomic=False)
        assert not fetcher.failed
        await deliver(found, wanted, prefilled=fetcher.prefilled)

    asyncio.run(run())


def test_a_later_batch_never_copies_from_an_earlier_batchs_destination(tmp_path: Path) -> None:
    data = os.urandom(8192)
    cid = blake3.blake3(data).hexdigest()
    cached = tmp_path / chunk_key(cid)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(data)
    server = PeerServer(host="127.0.0.1", port=0, token=TOKEN).start()
    server.publish(PeerIndex(step=1, chunks={cid: memoryview(data)}))
    cache = DirectoryCacheSource(tmp_path)
    client = PeerClient(TOKEN)
    fetcher = ChunkFetcher([cache, PeerSource({cid: [server.url]}, client)])
    try:
        # Batch 1: the chunk comes from the cache, copied into its destination there.
        first = bytearray(len(data))
        wanted = WantedChunks()
        wanted.add(cid, memoryview(first), "a", in_target=True)
        _batch(fetcher, wanted)
        assert first == data and fetcher.tier_of[cid] == "cache"
        # The caller's tensor is its own again (DCP's planner may post-process it in
        # commit_tensor, training may step); the cached copy goes away meanwhile.
        first[:] = bytes(len(first))
        cache.close()
        cached.unlink()
        # Batch 2: the same chunk, in two tensors, now from the peer.
        b, c = bytearray(len(data)), bytearray(len(data))
        wanted = WantedChunks()
        wanted.add(cid, memoryview(b), "b", in_target=True)
        wanted.add(cid, memoryview(c), "c", in_target=True)
        _batch(fetcher, wanted)
        assert fetcher.tier_of[cid] == "peer"
        assert b == data
        assert c == data, "the second tensor was copied from the first batch's tensor"
    finally:
        fetcher.close()
        client.close()
        server.close()


def test_a_batch_keeps_no_view_of_an_earlier_batchs_memory(tmp_path: Path) -> None:
    # Each batch's destinations are held by the fetcher only while that batch runs:
    # a load of many batches stays within its read budget.
    chunks = [os.urandom(4096) for _ in range(3)]
    ids = [blake3.blake3(d).hexdigest() for d in chunks]
    for cid, d in zip(ids, chunks, strict=True):
        (tmp_path / chunk_key(cid)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / chunk_key(cid)).write_bytes(d)
    fetcher = ChunkFetcher([DirectoryCacheSource(tmp_path)])
    try:
        for cid, d in zip(ids, chunks, strict=True):
            dest = bytearray(len(d))
            wanted = WantedChunks()
            wanted.add(cid, memoryview(dest), cid, in_target=True)
            _batch(fetcher, wanted)
            assert dest == d
            assert set(fetcher.prefilled) <= {cid}
    finally:
        fetcher.close()
