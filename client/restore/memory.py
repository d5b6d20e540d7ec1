"""A restore's fresh memory: assembly buffers for tensors the target lacks, landing
memory for network chunks with no buffer of their own, and a worker that faults
both in ahead of the chunks.

Fresh pages are the restore's hidden cost: a 4 KiB page the kernel first meets
inside a socket read or a copy costs a fault each (0.7 s per GiB on one core of
the 2-core CI host), where ``MADV_POPULATE_WRITE`` over the same memory costs
0.3 s, in bulk and on a thread of its own (``Prefault``). A replacement rank's
optimizer is usually empty, so most of its state lands in such memory."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import threading
import warnings
from collections.abc import Callable, Sequence

import torch

from ckptd import knobs
from ckptd.knobs import MiB
from ckptd.pages import buffer_address, libc_madvise

MAP_FROM = 4 * MiB  # fresh buffers this large are anonymous maps of their own

Span = tuple[int, int]  # (address, length)


class Landing:
    """Fresh memory for chunks that arrive over the network and have no fresh
    buffer of their own to land in: anonymous maps in blocks, handed out in order.
    ``expect``: the bytes that will land, when known; then one map holds them all
    (mapped at once, faulted in as it is used or by a ``Prefault``)."""

    def __init__(self, block: int = 256 * MiB, expect: int = 0) -> None:
        self.block = block
        self._current: memoryview | None = fresh_bytes(expect) if expect > 0 else None
        self._used = 0

    def take(self, n: int) -> memoryview:
        if self._current is None or self._used + n > len(self._current):
            self._current = fresh_bytes(max(n, self.block))
            self._used = 0
        view = self._current[self._used : self._used + n]
        self._used += n
        return view

    def ahead(self) -> memoryview | None:
        """What is not handed out yet of the current map (None: nothing mapped)."""
        if self._current is None:
            return None
        return self._current[self._used :]


class Prefault:
    """Faults in fresh memory on a thread of its own, ahead of the chunks that will
    land in it (``MADV_POPULATE_WRITE``, Linux 5.14; where the kernel has no such
    advice, the pages fault in as chunks land, as before).

    ``first``: where the chunks land in the order they are fetched; a span the
    fetch has reached (``reached()`` counts the chunks started) is skipped, since
    its chunk faults it in as it lands. ``then``: fresh memory that delivery fills
    after every chunk verified. The thread ends by itself when it has advised all;
    ``stop`` ends it sooner (what was faulted in stays valid)."""

    PIECE = 16 * MiB
    ADVICE = 23  # MADV_POPULATE_WRITE
    SMALLEST = 64 * 1024  # smaller spans fault in cheaper than a call to advise them

    def __init__(self, first: Sequence[Span], then: Sequence[Span],
                 reached: Callable[[], int], keep: Sequence[object]) -> None:
        self._first = list(first)
        self._then = [s for s in then if s[1] >= self.SMALLEST]
        self._reached = reached
        self._keep = list(keep)  # the buffers advised, alive while the thread runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-prefault", daemon=True)

    @classmethod
    def start(cls, first: Sequence[Span], then: Sequence[Span],
              reached: Callable[[], int], keep: Sequence[object]) -> Prefault | None:
        """A running ``Prefault``, or None where there is nothing worth faulting in
        or no way to advise it."""
        if _MADVISE is None or sum(n for _, n in (*first, *then)) < MAP_FROM:
            return None
        pre = cls(first, then, reached, keep)
        pre._thread.start()
        return pre

    def _run(self) -> None:
        try:
            k = 0
            while k < len(self._first) and not self._stop.is_set():
                k = max(k, self._reached())  # never behind the chunks
                if k < len(self._first):
                    address, n = self._first[k]
                    if n >= self.SMALLEST and not self._advise(address, n):
                        return
                k += 1
            for address, n in self._then:
                if self._stop.is_set() or not self._advise(address, n):
                    return
        finally:
            self._keep = []

    def _advise(self, address: int, n: int) -> bool:
        """Faults in the pages of ``[address, address + n)``; False when the kernel
        refuses (no such advice, or memory is short: then they fault as used)."""
        advise = _MADVISE
        page = mmap.PAGESIZE
        start = address - address % page
        end = address + n
        while start < end:
            if self._stop.is_set():
                return True
            piece = min(self.PIECE, end - start)
            if advise is None or advise(ctypes.c_void_p(start), ctypes.c_size_t(piece),
                                        self.ADVICE) != 0:
                return False
            start += piece
        return True

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ReadIn:
    """Reads in the pages of mapped memory (``MADV_POPULATE_READ``, Linux 5.14) on
    threads of their own, last piece first: a restore starts it on its staging
    pool's maps while it loads the plan, when the cores mostly wait on the server,
    so that its hashes, which start at the first piece, find the pages mapped
    instead of faulting them in (40 ms of CPU per GiB on the 2-core CI host).
    ``stop`` ends it sooner; the threads end by themselves when all is read in or
    the kernel refuses (then the pages fault in as they are read, as before)."""

    PIECE = 16 * MiB
    ADVICE = 22  # MADV_POPULATE_READ

    def __init__(self, spans: Sequence[Span], threads: int, keep: Sequence[object]) -> None:
        page = mmap.PAGESIZE
        pieces = []
        for address, n in spans:
            start, end = address - address % page, address + n
            pieces += [(a, min(self.PIECE, end - a)) for a in range(start, end, self.PIECE)]
        self._pieces = pieces[::-1]
        self._next = iter(range(len(self._pieces)))
        self._take = threading.Lock()
        self._keep = list(keep)  # the maps read in, alive while the threads run
        self._stop = threading.Event()
        # None reads in before every thread is started: reading in holds the map
        # lock, which a thread's start (its stack's map) waits for; started one by
        # one behind the others' reads, 15 threads took 24 - 30 ms to start on 16
        # cores (93 ms on 2).
        self._go = threading.Event()
        self._threads = [threading.Thread(target=self._run, name="ckptd-read-in", daemon=True)
                         for _ in range(max(1, threads))]

    @classmethod
    def start(cls, spans: Sequence[Span], threads: int, keep: Sequence[object]
              ) -> ReadIn | None:
        """A running ``ReadIn``, or None where there is nothing worth reading in or
        no way to advise it."""
        if _MADVISE is None or sum(n for _, n in spans) < MAP_FROM:
            return None
        read_in = cls(spans, threads, keep)
        started = []
        try:
            for t in read_in._threads:
                t.start()
                started.append(t)
        except BaseException as exc:  # (no thread to be had, or an interrupt)
            read_in._stop.set()
            read_in._go.set()  # (the started ones end at once, not wait for ever)
            for t in started:
                t.join()
            if not isinstance(exc, RuntimeError):
                raise
            return None  # pages fault in as they are read
        read_in._go.set()
        return read_in

    def _run(self) -> None:
        self._go.wait()
        advise = _MADVISE
        while advise is not None and not self._stop.is_set():
            with self._take:
                k = next(self._next, None)
            if k is None:
                return
            address, n = self._pieces[k]
            if advise(ctypes.c_void_p(address), ctypes.c_size_t(n), self.ADVICE) != 0:
                self._stop.set()  # refused (an old kernel): the rest faults in as read
                return

    def stop(self) -> None:
        """Ends the reading in and waits for it (before the maps may go)."""
        self._stop.set()
        for t in self._threads:
            t.join()
        self._keep = []


_MADVISE = libc_madvise()


def span_of(view: memoryview) -> Span:
    """Where a buffer's bytes lie: (address, length)."""
    if len(view) == 0:
        return 0, 0
    return buffer_address(view), len(view)


def fresh_bytes(n: int) -> memoryview:
    """``n`` writable fresh bytes; large ones from an anonymous map of their own
    (given back whole when dropped), advised to use transparent huge pages only
    when ``CKPTD_RESTORE_HUGE_PAGES`` asks (see ``knobs.restore_huge_pages``)."""
    if n < MAP_FROM:
        return memoryview(bytearray(n))
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if knobs.restore_huge_pages():
        with contextlib.suppress(AttributeError, OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mm)


def fresh_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones in a map of their own (``fresh_bytes``)."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n < MAP_FROM:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about its own writability checks
        flat = torch.frombuffer(fresh_bytes(n), dtype=torch.uint8)
    return flat.view(dtype).view(tuple(shape))
