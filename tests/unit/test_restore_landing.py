"""Landing memory: an atomic restore's network chunks land in one map faulted in
ahead of them by a worker thread (``fetch.Prefault``)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from ckptd.client.restore import fetch
from ckptd.knobs import MiB

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux advice")


def _resident(view: memoryview) -> float:
    """The share of ``view``'s pages in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    base = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    pages = -(-len(view) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(len(view)), vec) == 0
    return sum(v & 1 for v in vec) / pages


def _populate_works() -> bool:
    if fetch._MADVISE is None:
        return False
    probe = fetch.fresh_bytes(8 * MiB)
    base = int(np.frombuffer(probe, dtype=np.uint8).ctypes.data)
    return fetch._MADVISE(ctypes.c_void_p(base), ctypes.c_size_t(len(probe)),
                          fetch.Prefault.ADVICE) == 0


@linux_only
def test_the_expected_landing_is_faulted_in_ahead_of_the_chunks() -> None:
    if not _populate_works():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    landing = fetch.Landing(expect=64 * MiB)
    first = landing.take(4 * MiB)
    pre = landing._prefault
    assert pre is not None, "no worker faulted the landing in"
    pre._thread.join(timeout=30)
    assert not pre._thread.is_alive()
    block = landing._current
    assert block is not None and len(block) == 64 * MiB  # one map for what will land
    # Untouched by any chunk, yet in memory: the worker faulted it in.
    assert _resident(block[8 * MiB :]) > 0.99
    rest = [landing.take(4 * MiB) for _ in range(15)]
    assert all(v.obj is first.obj for v in rest)  # the same map, no new block
    landing.close()
    assert landing._prefault is None


@linux_only
def test_closing_the_landing_stops_the_worker_and_leaves_what_landed() -> None:
    landing = fetch.Landing(expect=256 * MiB)
    view = landing.take(MiB)
    view[:5] = b"chunk"
    pre = landing._prefault
    landing.close()
    if pre is not None:
        assert not pre._thread.is_alive()
    assert bytes(view[:5]) == b"chunk"
    more = landing.take(MiB)  # still usable after close: it only stops faulting ahead
    more[:1] = b"x"


def test_without_an_expectation_landing_comes_in_blocks() -> None:
    landing = fetch.Landing(block=8 * MiB)
    views = [landing.take(3 * MiB) for _ in range(3)]
    assert landing._prefault is None
    assert views[0].obj is views[1].obj and views[2].obj is not views[0].obj
    landing.close()
