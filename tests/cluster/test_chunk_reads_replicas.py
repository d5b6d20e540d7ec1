"""Reads of several chunks per request over replicas: each goes to its chunk's home."""

from __future__ import annotations

import asyncio
import os

from ckptd.client.restore.sources import verify_hash
from ckptd.client.transport import open_transport
from ckptd.hashing import chunk_id
from tests.cluster.conftest import Cluster


def test_each_replica_answers_the_reads_of_its_own_chunks(lease_cluster: Cluster) -> None:
    """Two replicas over one store: a batched read goes to each chunk's home, so both
    answer some, and every chunk comes back verified."""
    lease_cluster.add()
    lease_cluster.add()
    chunks = [os.urandom(1000 + i) for i in range(16)]

    async def run() -> None:
        transport = open_transport(lease_cluster.urls)
        try:
            for data in chunks:
                await transport.put_chunk(chunk_id(data), data)
            reads = transport.chunk_reads(verify_hash)
            assert reads is not None
            got = await asyncio.gather(*(reads.read(chunk_id(d), memoryview(bytearray(len(d))))
                                         for d in chunks))
            assert got == [chunk_id(d) for d in chunks]
            reads.close()
        finally:
            await transport.close()

    asyncio.run(run())
    served = [r.metric("ckptd_chunk_read_seconds_count") for r in lease_cluster.replicas]
    assert sum(served) == len(chunks)
    assert all(n > 0 for n in served), served
