"""Large objects a local store writes around the page cache (``ckptd.store.direct_io``):
the bytes are the same, the pages are not left in the cache, and what cannot go
direct (a buffer off a page, a filesystem that refuses) goes through the cache."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from ckptd.hashing import chunk_id
from ckptd.keys import chunk_key
from ckptd.knobs import MiB
from ckptd.store import direct_io
from ckptd.store.local import LocalStore
from tests.residency import cached_share

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT, mincore")


def page_aligned_bytes(size: int, seed: int = 0) -> mmap.mmap:
    buf = mmap.mmap(-1, size)
    buf[:] = np.random.default_rng(seed).bytes(size)
    return buf


def put(store: LocalStore, data: bytes | bytearray | mmap.mmap | memoryview) -> Path:
    cid = chunk_id(memoryview(data))
    assert store._put_if_absent(chunk_key(cid), memoryview(data))
    path = store.local_path(chunk_key(cid))
    assert path is not None
    assert path.read_bytes() == bytes(data)
    return path


def store_unread(store: LocalStore, data: mmap.mmap) -> Path:
    """Puts ``data`` as its chunk; the file's path, not read since (its pages in
    the cache are what the write left)."""
    cid = chunk_id(memoryview(data))
    assert store._put_if_absent(chunk_key(cid), memoryview(data))
    path = store.local_path(chunk_key(cid))
    assert path is not None
    return path


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_DIRECT_WRITES", raising=False)
    monkeypatch.setattr(direct_io, "_refused", set())


def _direct_fd(path: Path) -> int | None:
    """``path`` created and opened for writing with O_DIRECT; None when the
    filesystem refuses it (at the open or at F_SETFL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    return fd


def _bypasses_cache(folder: Path) -> str | None:
    """Why ``folder``'s filesystem cannot show a write around the page cache (None
    when it can): it refuses O_DIRECT, keeps its files in memory (tmpfs), or does
    not keep a written file in the page cache at all (ZFS's own cache)."""
    probe = folder / "probe"
    try:
        probe.write_bytes(bytes(page_aligned_bytes(MiB)))
        if cached_share(probe, MiB) < 0.5:
            return "this filesystem does not cache written files in the page cache"
        probe.unlink()
        fd = _direct_fd(probe)
        if fd is None:
            return "this filesystem refuses O_DIRECT"
        try:
            os.pwrite(fd, page_aligned_bytes(MiB), 0)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return "this filesystem refuses O_DIRECT"
            raise
        finally:
            os.close(fd)
        if cached_share(probe, MiB) > 0.5:
            return "this filesystem keeps its files in memory (tmpfs)"
        return None
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def around_cache(tmp_path: Path) -> Path:
    """``tmp_path``, on a filesystem where a write around the cache shows."""
    why = _bypasses_cache(tmp_path)
    if why:
        pytest.skip(why)
    return tmp_path


def test_a_large_page_aligned_object_is_stored_around_the_cache(around_cache: Path) -> None:
    store = LocalStore(around_cache)
    # A tail off a page (1000 bytes): written through the cache after the rest.
    data = page_aligned_bytes(4 * MiB + 1000, seed=2)
    assert direct_io.worth_it(data)
    path = store_unread(store, data)
    assert cached_share(path, 4 * MiB) < 0.01  # looked at before anything reads it
    assert path.read_bytes() == bytes(data)
    assert not direct_io._refused


def test_with_direct_writes_off_the_object_stays_in_the_cache(
    around_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_DIRECT_WRITES", "0")
    store = LocalStore(around_cache)
    data = page_aligned_bytes(4 * MiB, seed=3)
    assert not direct_io.worth_it(data)
    assert cached_share(store_unread(store, data), 4 * MiB) > 0.9


def test_a_buffer_off_a_page_and_a_small_object_go_through_the_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    whole = page_aligned_bytes(4 * MiB + 8, seed=4)
    off = memoryview(whole)[8:]  # starts 8 bytes into a page
    assert not direct_io.worth_it(off)
    assert not direct_io.worth_it(page_aligned_bytes(64 * 1024))  # under DIRECT_FROM
    path = put(store, off)
    assert path.stat().st_size == 4 * MiB


def test_a_store_without_fsync_writes_through_the_cache(around_cache: Path) -> None:
    store = LocalStore(around_cache, fsync=False)
    data = page_aligned_bytes(4 * MiB, seed=5)
    assert cached_share(store_unread(store, data), 4 * MiB) > 0.9


def _refuses_misaligned(folder: Path) -> bool:
    probe = folder / "probe"
    fd = _direct_fd(probe)
    try:
        if fd is None:
            return False  # (it refuses O_DIRECT outright: nothing left to show)
        buf = mmap.mmap(-1, 2 * mmap.PAGESIZE)
        os.pwrite(fd, memoryview(buf)[1 : 1 + mmap.PAGESIZE], 0)
        return False
    except OSError as exc:
        return exc.errno == errno.EINVAL
    finally:
        if fd is not None:
            os.close(fd)
        probe.unlink(missing_ok=True)


def test_a_refused_direct_write_is_written_through_the_cache(tmp_path: Path) -> None:
    if not _refuses_misaligned(tmp_path):
        pytest.skip("this filesystem takes any buffer with O_DIRECT (nothing to refuse)")
    whole = page_aligned_bytes(4 * MiB + 1, seed=6)
    off = memoryview(whole)[1:]  # the kernel refuses O_DIRECT from it: EINVAL
    target = tmp_path / "object"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        direct_io.write_all(fd, off, direct=True)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert target.read_bytes() == bytes(off)
    # This filesystem is not asked again in this process: an aligned object is
    # written through the cache, and whole.
    assert direct_io._refused == {os.stat(tmp_path).st_dev}
    store = LocalStore(tmp_path / "store")
    data = page_aligned_bytes(4 * MiB, seed=7)
    path = put(store, data)
    assert cached_share(path, 4 * MiB) > 0.9


def test_an_upload_to_the_server_is_stored_around_the_cache(
        around_cache: Path, server) -> None:  # noqa: ANN001
    # The server's upload buffers start on a page (server/bodies.py): its store writes
    # them direct. Whether they did shows in the chunk file's pages.
    data = np.random.default_rng(7).bytes(4 * MiB)
    cid = chunk_id(data)
    r = httpx.put(f"{server.url}/v1/chunks/{cid}", content=data, timeout=30)
    assert r.status_code == 201, r.text
    path = Path(server.store) / chunk_key(cid)
    assert path.is_file()
    assert cached_share(path, 4 * MiB) < 0.01
    assert path.read_bytes() == data
