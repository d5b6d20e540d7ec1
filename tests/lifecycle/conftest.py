"""Lifecycle tests run against every backend: memory, a local directory, and S3
on moto's server (started once per module, as in tests/store/test_s3.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from ckptd.store import LocalStore, MemoryStore
from ckptd.store.base import Store


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("aiobotocore")
    pytest.importorskip("moto.server")
    from tests.store.test_s3 import endpoint

    gen = endpoint.__wrapped__()  # type: ignore[attr-defined]
    try:
        yield next(gen)
    finally:
        gen.close()


@pytest.fixture(params=["memory", "local", "s3"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
    elif request.param == "local":
        yield LocalStore(tmp_path / "store", fsync=False)
    else:
        endpoint: str = request.getfixturevalue("s3_endpoint")
        from ckptd.store import S3Store
        from tests.store.test_s3 import BUCKET

        store = S3Store(BUCKET, f"lc/{uuid.uuid4().hex}", endpoint_url=endpoint)
        yield store
        await store.close()


StoreFactory = Callable[[], Store]
