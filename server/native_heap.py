"""A server that runs for weeks and glibc's allocator.

glibc maps a block apart (and unmaps it when freed) only from a threshold that it
raises, by default, to the largest mapped block freed so far: after the first 4 MiB
chunk, every body, file read and manifest below 32 MiB comes from the heaps of the
threads that allocate it, where large blocks freed between long-lived small ones
are never given back. In ``bench/soak.py`` (4 ranks saving 4 MiB every 4 s) that
was a server's RSS growing ~90 MiB an hour with no Python object to show for it;
with the threshold fixed at 128 KiB the growth stopped (bench/RESULTS.md).
``CKPTD_MALLOC_MMAP_THRESHOLD`` sets it (0: glibc's own); ``MALLOC_MMAP_THRESHOLD_``
in the environment (glibc's own variable) is left to win."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from ckptd import knobs

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def bound_native_heap() -> int | None:
    """Fixes glibc's mmap threshold; the threshold set, or None when left alone (set
    to 0, set in glibc's own variable, or not glibc)."""
    threshold = knobs.malloc_mmap_threshold()
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
        gnu = ctypes.CDLL(name).gnu_get_libc_version if name else None
    except (OSError, AttributeError):
        return None
    if mallopt is None or gnu is None:  # (musl has mallopt, and ignores it)
        return None
    if mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold)) != 1:
        log.warning("glibc refused an mmap threshold of %d bytes "
                    "(CKPTD_MALLOC_MMAP_THRESHOLD): left as it was", threshold)
        return None
    return threshold
