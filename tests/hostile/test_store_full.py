"""A full disk answers truthfully (item 8): ``store_full`` (507, no retries), no
temporary or half-written object left behind, and a commit whose record is durable
says committed even when the ``latest`` ref could not be written."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.client import HttpTransport
from ckptd.errors import StoreFull
from ckptd.hashing import chunk_id
from ckptd.repository import Repository
from ckptd.store.local import LocalStore
from ckptd.testing.faults import FaultyStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]

@pytest.mark.asyncio
async def test_enospc_is_store_full_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "store")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    data = b"x" * 4096
    with pytest.raises(StoreFull):
        await store.put_if_absent(f"chunks/{chunk_id(data)[:2]}/{chunk_id(data)}", data)
    with pytest.raises(StoreFull):
        await store.compare_and_swap("jobs/j/refs/latest", None, b"ref")
    assert _leftovers(tmp_path) == []
    assert not await store.exists(f"chunks/{chunk_id(data)[:2]}/{chunk_id(data)}")
    assert not await store.exists("jobs/j/refs/latest")

@pytest.mark.asyncio
async def test_a_durable_commit_says_committed_when_latest_cannot_move(tmp_path: Path) -> None:
    store = FaultyStore(LocalStore(tmp_path / "store"))
    repo = Repository(store)
    for manifest, chunks in demo_step("j", 1, 2):
        await put_rank(repo, manifest, chunks)
    store.fail_at("compare_and_swap", exc=StoreFull("disk full"), match="refs/latest")
    status = await repo.commit("j", 1)
    assert status.state == "committed" and status.latest_moved is False
    assert await repo.try_read_commit("j", 1) is not None
    assert await repo.latest("j") is None
    again = await repo.commit("j", 1)  # space is back: the retry moves the ref
    assert again.state == "committed" and again.latest_moved is True
    assert await repo.latest("j") == 1

@pytest.fixture
def full_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose store is a 2 MiB tmpfs (needs the right to mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    srv = ServerProcess(store=mnt / "store")
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        subprocess.run(["umount", "-l", str(mnt)], check=False)

def test_a_full_disk_is_a_507_without_retries_or_leftovers(full_server: ServerProcess) -> None:
    stored = 0
    answer = None
    with httpx.Client(base_url=full_server.url, timeout=30) as c:
        for _ in range(64):
            data = os.urandom(256 * 1024)
            r = c.put(f"/v1/chunks/{chunk_id(data)}", content=data)
            if r.status_code != 201:
                answer = r
                break
            stored += 1
        assert answer is not None and stored > 0
        assert answer.status_code == 507, answer.text
        assert answer.json()["code"] == "store_full"
        assert c.get("/healthz").status_code == 200
    assert _leftovers(full_server.store) == []


    async def one_put() -> float:
        transport = HttpTransport(full_server.url, retries=5, backoff=0.5)
        data = os.urandom(256 * 1024)
        t0 = time.monotonic()
        try:
            with pytest.raises(StoreFull):
                await transport.put_chunk(chunk_id(data), data)
        finally:
            await transport.close()
        return time.monotonic() - t0

    # 5 retries with 0.5 s backoff would take over 15 s; none takes well under that.
    assert asyncio.run(one_put()) < 5.0
