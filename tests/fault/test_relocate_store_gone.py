"""A restore whose staging pool changed under it takes the pool's chunks again from
the store; when the store cannot be reached by then, the restore says so
(``Unavailable``: run it again), not that the checkpoint's chunks are lost."""

from __future__ import annotations

import asyncio
import os

import pytest

from ckptd.client.restore.fetch import ChunkFetcher, WantedChunks
from ckptd.client.restore.restorer import _relocate
from ckptd.client.restore.sources import StoreSource
from ckptd.client.transport import HttpTransport
from ckptd.errors import Unavailable
from ckptd.hashing import chunk_id
from tests.conftest import free_port

SIZE = 64 * 1024


def test_a_store_gone_while_the_pool_changed_is_unavailable() -> None:
    data = os.urandom(SIZE)
    cid = chunk_id(data)
    wanted = WantedChunks()
    wanted.add(cid, memoryview(bytearray(SIZE)), "w")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def relocate() -> None:
        transport = HttpTransport(url, retries=0)
        store = StoreSource(transport)
        # What phase 1 left: the chunk verified in the pool, which has since changed.
        fetcher = ChunkFetcher([store])
        fetcher.tier_of[cid] = "local"
        fetcher.bytes_from["local"] = SIZE
        try:
            await _relocate(fetcher, wanted, {cid: memoryview(data)}, [store])
        finally:
            store.close()
            await transport.close()

    with pytest.raises(Unavailable) as caught:
        asyncio.run(relocate())
    assert url in str(caught.value) and "run the restore again" in str(caught.value)
