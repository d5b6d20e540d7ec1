"""An object path of the local store that holds no regular file: a FIFO (put there by
hand or by a tool) is damage, read at once, where its reader blocked for good; a
directory is no object, as the store contract says for a key above objects."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from ckptd.errors import NotFound, StoreCorrupt
from ckptd.store import LocalStore

pytestmark = pytest.mark.timeout(60)

KEY = "chunks/ab/" + "ab" * 32


async def test_a_fifo_at_a_key_is_store_corrupt_not_a_hang(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    await store.put_if_absent("chunks/ab/other", b"x")  # (its directory)
    fifo = tmp_path / "store" / KEY
    os.mkfifo(fifo)
    read = asyncio.ensure_future(store.get(KEY))
    done, _ = await asyncio.wait({read}, timeout=5)
    if not done:  # the reader waits for a writer: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        await asyncio.wait({read}, timeout=5)
        pytest.fail("a get of a FIFO blocked")
    with pytest.raises(StoreCorrupt) as info:
        await read
    assert info.value.detail["key"] == KEY and KEY in info.value.message
    assert not await store.exists(KEY)


async def test_a_directory_at_a_key_is_no_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store" / KEY).mkdir(parents=True)
    with pytest.raises(NotFound):
        await store.get(KEY)
