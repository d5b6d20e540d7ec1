"""The CUDA side of staging: pinning pool pages, a side stream per device, and the
events that order the staging copies after the training stream and tell when they
are done.

Nothing here runs unless the state holds CUDA tensors, so a CPU-only process (or a
CPU-only state on a GPU machine) never creates a CUDA context: a context on the
wrong device costs every rank hundreds of MiB of GPU memory on device 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from ckptd import knobs
from ckptd.errors import Timeout

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: the pinned pages count as pinned for every CUDA context,
# whichever device a rank's tensors live on.
_HOST_REGISTER_PORTABLE = 1


def _on(device: torch.device | None) -> contextlib.AbstractContextManager[object]:
    """Makes a CUDA ``device`` current for a runtime call (nothing for another or
    None): a thread with no current device would make one on device 0, a context
    that costs hundreds of MiB there."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def available() -> bool:
    """True when this torch build can reach a CUDA device (initializes nothing)."""
    return torch.cuda.is_available()


def pin(ptr: int, nbytes: int, device: torch.device | None = None) -> bool:
    """Page-locks ``nbytes`` at ``ptr`` (a pool segment) with cudaHostRegister, so
    device-to-host copies into it run asynchronously on a stream.

    False (and a warning) when CUDA refuses, e.g. over the locked-memory limit: the
    copies then still land correctly, but synchronously."""
    if nbytes == 0:
        return False
    with _on(device):
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))  # type: ignore[no-untyped-call]
    if err != 0:
        log.warning("staging: cudaHostRegister of %d bytes failed (cudaError %d); copies "
                    "into this segment will be synchronous", nbytes, err)
        return False
    return True


def unpin(ptr: int, device: torch.device | None = None) -> None:
    """Undoes ``pin`` (on ``device``, as ``pin`` ran); the caller makes sure no copy
    into the pages is running."""
    with _on(device):
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]
    if err != 0:
        log.warning("staging: cudaHostUnregister failed (cudaError %d)", err)


class CopyDone:
    """The events recorded on the side streams after one stage's copies.

    ``synchronize`` blocks the host until they completed; ``block_streams`` makes the
    devices' current streams wait for them instead (no host block: later kernels on
    those streams run after the copies)."""

    def __init__(self, events: list[tuple[torch.device, torch.cuda.Event]]) -> None:
        self.events = events
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._ended = threading.Event()
        self._failed: BaseException | None = None

    def query(self) -> bool:
        """True once every copy finished."""
        for device, e in self.events:
            with _on(device):
                if not e.query():  # type: ignore[no-untyped-call]
                    return False
        return True

    def synchronize(self, timeout: float | None = None) -> None:
        """Blocks until every copy finished; ``Timeout`` after ``timeout`` seconds
        (None, or more than a lock can wait: no limit)."""
        if timeout is None or not timeout < threading.TIMEOUT_MAX:
            self._wait_events()
            return
        if not self._ended.is_set() and self.query():
            return
        # One thread sleeps on the events and wakes every caller the moment they
        # complete: polling them with a growing sleep noticed a 40 ms copy's end up
        # to 10 ms late, a quarter more stall for the training loop. (One per stage,
        # however often asked; after a timeout it ends with the copies.)
        with self._lock:
            if self._waiter is None:
                waiter = threading.Thread(target=self._wait_for_all, name="ckptd-staged",
                                          daemon=True)
                try:
                    waiter.start()
                except RuntimeError:  # (no thread to be had: wait on this one)
                    self._wait_events()
                    return
                self._waiter = waiter
        if not self._ended.wait(timeout):
            raise Timeout(f"staging copies still running after {timeout} s")
        if self._failed is not None:
            raise self._failed.with_traceback(None)

    def _wait_for_all(self) -> None:
        try:
            self._wait_events()
        except BaseException as exc:  # (told to the callers, not printed by this thread)
            self._failed = exc
        finally:
            self._ended.set()

    def _wait_events(self) -> None:
        for device, e in self.events:
            with _on(device):  # (on the event's own device)
                e.synchronize()  # a blocking-sync event: the thread sleeps, no spin

    def block_streams(self) -> None:
        """Makes each device's current stream wait for the copies (returns at once)."""
        for device, e in self.events:
            torch.cuda.current_stream(device).wait_event(e)


def record_ready(devices: Iterable[torch.device]) -> dict[torch.device, torch.cuda.Event]:
    """An event recorded now on each device's current stream (of this thread)."""
    out: dict[torch.device, torch.cuda.Event] = {}
    for device in devices:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        out[device] = event
    return out


class CopyStreams:
    """One side stream per device for staging copies, kept for the pool's lifetime.

    Use: ``begin(devices)`` orders each side stream after the work already queued
    on that device's current stream (so the copies see the tensors as they are when
    ``save`` is called, in stream order), ``on(device)`` while issuing the copies with
    ``non_blocking=True``, and ``finish()`` for the ``CopyDone`` events."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._active: list[torch.device] = []

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return s

    def begin(self, devices: Iterable[torch.device],
              ready: Mapping[torch.device, torch.cuda.Event] | None = None) -> None:
        """Orders each side stream after ``ready[device]`` (events the caller
        recorded on its own thread's streams) or else after this thread's current
        stream: CUDA's current stream is per thread."""
        self._active = sorted(set(devices), key=lambda d: d.index or 0)
        here = record_ready([d for d in self._active if ready is None or d not in ready])
        for device in self._active:
            event = ready[device] if ready is not None and device in ready else here[device]
            self.stream(device).wait_event(event)

    @contextmanager
    def on(self, device: torch.device) -> Iterator[torch.cuda.Stream]:
        s = self.stream(device)
        with torch.cuda.device(device), torch.cuda.stream(s):
            yield s

    def finish(self) -> CopyDone:
        events = []
        for device in self._active:
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self.stream(device))
            events.append((device, done))
        self._active = []
        return CopyDone(events)

    def synchronize(self) -> None:
        """Waits for every copy ever issued (before unpinning or unmapping)."""
        for s in self._streams.values():
            s.synchronize()


class CudaLane:
    """One restore thread's way to a CUDA device (``restore.devices.Lane``): a side
    stream of its own that first waits for ``ready`` (the work the caller had
    queued), and two page-locked bounce buffers of ``piece`` bytes, each reused
    only once the copy out of it finished.

    ``active()`` makes the device and the stream current on the thread, once for
    all its copies: entering both per copy cost a fifth of a restore's thread time
    on an H100 (bench/RESULTS.md, the 2026-11-27 GPU rows)."""

    def __init__(self, device: torch.device, ready: torch.cuda.Event | None,
                 piece: int) -> None:
        self.device = device
        self.piece = piece
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        if ready is not None:
            self.stream.wait_event(ready)
        self._buffers: list[torch.Tensor | None] = [None, None]
        # One event per bounce buffer, recorded again at each send out of it.
        self._sent: list[torch.cuda.Event | None] = [None, None]
        self._blocking = knobs.h2d_blocking_events()
        self._active = False

    @contextmanager
    def active(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._active = True
            try:
                yield
            finally:
                self._active = False

    def direct(self, src: torch.Tensor) -> bool:
        try:
            return bool(src.is_pinned())
        except RuntimeError:
            return False

    def bounce(self, k: int) -> torch.Tensor:
        sent = self._sent[k]
        if sent is not None:
            sent.synchronize()  # the DMA out of it is done: it may be written again
        buf = self._buffers[k]
        if buf is None:
            buf = self._buffers[k] = torch.empty(self.piece, dtype=torch.uint8,
                                                 pin_memory=True)
        return buf

    def send(self, dst: torch.Tensor, src: torch.Tensor, bounce: int | None = None) -> None:
        if not self._active:  # (a caller outside ``active``: made current for this copy)
            with self.active():
                self.send(dst, src, bounce)
            return
        dst.copy_(src, non_blocking=True)
        if bounce is not None:
            event = self._sent[bounce]
            if event is None:
                event = self._sent[bounce] = torch.cuda.Event(  # type: ignore[no-untyped-call]
                    blocking=self._blocking)
            event.record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()
