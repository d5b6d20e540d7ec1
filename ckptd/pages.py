"""Read-only maps of chunk files that cannot kill the process that reads them.

A byte of a mapped file that the kernel cannot read (an I/O error on the disk, or
a file cut short after it was mapped) is a SIGBUS at the instruction that touches
it: in the server, the whole process and every job it serves. ``map_readable``
maps a file and faults every page in at once with ``MADV_POPULATE_READ``, where
the kernel answers such a page with an error instead of the signal; the caller
then reads the file through the store, whose ``read()`` fails that one request.

What is left: the pages are file cache, and under memory pressure the kernel may
drop one after the check and read it again when it is sent. The window is that
send; an error in it is rare twice over (a bad sector, and a reclaim in between).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path

MADV_POPULATE_READ = 22  # Linux 5.14 (<linux/mman.h>); not in Python 3.11's mmap

# A read of a chunk file that fails with one of these says the file itself is
# damaged (a link that loops, the disk's read error, a file system that found its
# own damage): damage to that chunk, not a store that cannot be read.
DAMAGED_ERRNOS = frozenset({errno.ELOOP, errno.EIO, errno.EUCLEAN, errno.EBADMSG})


def libc_madvise() -> Callable[..., int] | None:
    """libc's ``madvise`` through ctypes (which lets the GIL go while it runs;
    ``mmap.madvise`` holds it), on Linux only."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = libc_madvise()


def buffer_address(view: memoryview) -> int:
    """Where a buffer's first byte lies in memory (a read-only buffer too)."""
    if not view.readonly:  # (1 us where numpy's way takes 4-5: a restore asks per chunk)
        with contextlib.suppress(TypeError, ValueError):
            return ctypes.addressof(ctypes.c_char.from_buffer(view))
    import numpy as np  # (here: the CLI starts without it, 130 ms less per command)

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def populate_read(view: memoryview) -> bool:
    """Faults in every page of a mapped ``view``; False when a page cannot be read
    (it would have been a SIGBUS). True as well where the kernel has no such advice
    (before 5.14, or not Linux): there the pages fault as they are read, as before."""
    if len(view) == 0 or _MADVISE is None:
        return True
    address = buffer_address(view)
    page = mmap.PAGESIZE
    start = address - address % page
    if _MADVISE(ctypes.c_void_p(start), ctypes.c_size_t(address + len(view) - start),
                MADV_POPULATE_READ) == 0:
        return True
    return ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS)


def map_readable(path: Path) -> memoryview | None:
    """A read-only map of the file at ``path`` with every page read in; None when the
    file is not there or a page of it cannot be read (the caller reads it otherwise,
    and meets the error there). The map closes when the last view of it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            return memoryview(b"")
        except OSError:  # out of maps or memory: read it otherwise
            return None
    finally:
        os.close(fd)
    view = memoryview(mm)
    if populate_read(view):
        return view
    view.release()
    with contextlib.suppress(BufferError):
        mm.close()
    return None
