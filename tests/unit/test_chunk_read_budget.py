"""The multi-chunk read route gives back its egress reservation when reading a
chunk fails (a store error, a reader gone): else each failure kept a chunk's worth
of the budget, and a server on S3 stopped serving chunks after about 64 of them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from ckptd.errors import StoreError
from ckptd.hashing import chunk_id
from ckptd.repository import Repository
from ckptd.server.egress import EgressBudget
from ckptd.server.routes import chunks as routes
from ckptd.store.memory import MemoryStore
from ckptd.testing.faults import FaultyStore


async def test_a_failed_chunk_read_gives_its_reservation_back() -> None:
    store = FaultyStore(MemoryStore())  # not files here: read whole, under the budget
    repo = Repository(store)
    data = os.urandom(1 << 20)
    cid = chunk_id(data)
    await repo.put_chunk(cid, data)
    budget = EgressBudget(4 << 20, 0.1)
    app = SimpleNamespace(state=SimpleNamespace(egress=budget, settings=None))
    request = SimpleNamespace(state=SimpleNamespace(acting_job=None), app=app, headers={})
    body = SimpleNamespace(ids=[cid])
    for _ in range(8):  # more failures than the budget has chunks
        store.fail_at("get", match=cid)
        with pytest.raises(StoreError):
            await routes.read_chunks(body, request, repo, None, None)  # type: ignore[arg-type]
        assert budget.held == 0
    answer = await routes.read_chunks(body, request, repo, None, None)  # type: ignore[arg-type]
    assert answer.headers[routes.CHUNK_SIZES_HEADER] == str(len(data))
