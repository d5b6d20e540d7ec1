"""Chunk bodies in the server: one buffer per upload, reused by later uploads."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from ckptd import knobs
from ckptd.hashing import chunk_id
from ckptd.server.bodies import BodyBuffers

if TYPE_CHECKING:
    from tests.conftest import ServerProcess


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=30.0) as c:
        yield c


async def test_concurrent_uploads_of_one_size_each_store_their_own_bytes(
    server: ServerProcess,
) -> None:
    # Same-size bodies share reused buffers: a buffer handed to the next upload
    # while a store still wrote it would store (or serve) another chunk's bytes.
    size = 2 * knobs.MiB
    bodies = [os.urandom(size) for _ in range(24)]
    ids = [chunk_id(b) for b in bodies]
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers(), timeout=60.0, limits=limits
    ) as c:
        for _ in range(2):  # the second round finds the first round's buffers idle
            answers = await asyncio.gather(
                *(c.put(f"/v1/chunks/{cid}", content=b) for cid, b in zip(ids, bodies, strict=True))
            )
            assert all(r.status_code in (200, 201) for r in answers), answers
        for cid, body in zip(ids, bodies, strict=True):
            r = await c.get(f"/v1/chunks/{cid}")
            assert r.status_code == 200, r.text
            assert r.content == body


def test_refused_upload_leaves_later_ones_of_its_size_intact(client: httpx.Client) -> None:
    size = knobs.MiB + 3
    bad = os.urandom(size)
    r = client.put(f"/v1/chunks/{chunk_id(os.urandom(size))}", content=bad)
    assert r.status_code == 422
    good = os.urandom(size)
    cid = chunk_id(good)
    assert client.put(f"/v1/chunks/{cid}", content=good).status_code == 201
    assert client.get(f"/v1/chunks/{cid}").content == good


def test_chunked_upload_longer_than_the_first_buffer(client: httpx.Client) -> None:
    data = os.urandom(5 * knobs.MiB + 11)  # grows the buffer several times
    cid = chunk_id(data)

    def pieces() -> Iterator[bytes]:
        for a in range(0, len(data), 300_000):
            yield data[a : a + 300_000]

    assert client.put(f"/v1/chunks/{cid}", content=pieces()).status_code == 201
    assert client.get(f"/v1/chunks/{cid}").content == data


async def test_body_buffers_reuse_by_exact_size_within_their_bound() -> None:
    mib = knobs.MiB
    buffers = BodyBuffers(keep=3 * mib, idle_s=60.0)
    first = buffers.take(mib)
    buffers.give(first)
    assert buffers.take(mib) is first
    assert buffers.take(mib) is not first  # taken: not handed out twice
    buffers.give(first)
    assert len(buffers.take(mib + 1)) == mib + 1  # no other size is handed out
    for _ in range(4):
        buffers.give(bytearray(mib))
    assert buffers.idle_bytes == 3 * mib  # the oldest went
    buffers.give(bytearray(1024))  # small ones cost little to allocate: not kept
    buffers.give(bytearray(4 * mib))  # over the bound: not kept
    assert buffers.idle_bytes == 3 * mib


async def test_body_buffers_go_once_uploads_stop() -> None:
    buffers = BodyBuffers(keep=4 * knobs.MiB, idle_s=0.05)
    buffers.give(bytearray(knobs.MiB))
    await asyncio.sleep(0.03)
    buffers.give(bytearray(knobs.MiB))  # a give pushes the expiry back
    await asyncio.sleep(0.04)
    assert buffers.idle_bytes == 2 * knobs.MiB
    await asyncio.sleep(0.1)
    assert buffers.idle_bytes == 0
