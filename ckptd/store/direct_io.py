"""Large objects written around the page cache (``O_DIRECT``).

A local store fsyncs every object it writes, so a chunk's bytes go to the device
before its put returns either way. Written through the page cache they are first
copied into freshly allocated cache pages, then written back from there at the
fsync: that copy, the pages' allocation and their writeback were a third of a
server's CPU under ingest (bench/RESULTS.md), and on a VM whose host reclaims
free memory a fresh page costs up to ten times more. With ``O_DIRECT`` the device
reads the caller's buffer itself; the fsync then flushes metadata and the
device's cache only.

Only where it is safe and cheap: the store fsyncs, the object is at least
``DIRECT_FROM`` bytes, and the caller's buffer starts on a page (the server's
upload buffers and a client's staging pool do). The page-aligned prefix goes
direct, the rest (under a page) through the cache, then one fsync covers both. A
filesystem that refuses ``O_DIRECT`` (``EINVAL``, ``EOPNOTSUPP``), or a write it refuses
part-way, is written through the cache instead, and this process does not ask
that filesystem again.

What it changes for readers: nothing in what they read (the kernel drops cached
pages a direct write covers); a chunk just stored is read from the device, not
from the cache, the first time. ``CKPTD_DIRECT_WRITES=0`` turns it off.
"""

from __future__ import annotations

import errno
import fcntl
import os

from ckptd import knobs
from ckptd.pages import buffer_address

ALIGN = 4096  # the largest logical block size a device asks O_DIRECT to align to
DIRECT_FROM = knobs.MiB
# How a filesystem says it will not do O_DIRECT (at F_SETFL or at the write).
_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP})

# The filesystems (``st_dev``) that refused O_DIRECT in this process: written
# through the page cache from then on.
_refused: set[int] = set()


def page_aligned(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data``'s first byte starts a page (a read-only buffer too)."""
    view = memoryview(data)
    if not view.c_contiguous or view.nbytes == 0:
        return False
    return buffer_address(view.cast("B")) % ALIGN == 0


def worth_it(data: bytes | bytearray | memoryview) -> bool:
    """Whether an object of these bytes is worth writing direct (see the module)."""
    return knobs.direct_writes() and len(data) >= DIRECT_FROM and page_aligned(data)


def write_all(fd: int, data: bytes | bytearray | memoryview, *, direct: bool) -> None:
    """Writes every byte of ``data`` at offset 0 of ``fd`` (a new, empty file),
    the page-aligned prefix with ``O_DIRECT`` when ``direct``; the caller fsyncs."""
    view = memoryview(data).cast("B")
    done = 0
    if direct and os.fstat(fd).st_dev not in _refused:
        done = _write_direct(fd, view)
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def _write_direct(fd: int, view: memoryview) -> int:
    """Writes the page-aligned prefix of ``view`` with O_DIRECT; the bytes written
    (0 when the filesystem refused: the caller writes them all through the cache).
    Leaves ``fd`` without O_DIRECT."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno not in _REFUSALS:
            raise
        _refused.add(os.fstat(fd).st_dev)
        return 0
    done = 0
    end = len(view) - len(view) % ALIGN
    try:
        while done < end:
            n = os.pwrite(fd, view[done:end], done)
            if n <= 0:
                break
            done += n
            if n % ALIGN:
                break  # (a short write off a block: the rest goes through the cache)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            pass  # memory the kernel cannot pin for a DMA (a device's mapping): this
            # write goes through the cache, which reports a buffer really bad itself
        elif exc.errno in _REFUSALS:
            _refused.add(os.fstat(fd).st_dev)
        else:
            raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done
