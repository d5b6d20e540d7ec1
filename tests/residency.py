"""Which pages of a buffer are in memory (``mincore``): the test of memory a restore
faults in ahead, and of a file a write left in the page cache or not."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

from ckptd.pages import buffer_address


def resident_share(view: memoryview) -> float:
    """The share of ``view``'s pages in memory."""
    page = mmap.PAGESIZE
    base = buffer_address(view)
    pages = -(-len(view) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(len(view)), vec) == 0
    return sum(v & 1 for v in vec) / pages


def cached_share(path: Path, length: int) -> float:
    """The share of the first ``length`` bytes of the file at ``path`` in the page
    cache (mapping it reads nothing in)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ) as m:
        view = memoryview(m)
        try:
            return resident_share(view)
        finally:
            view.release()
