"""Verified host bytes into device tensors: several threads, each with a stream of
its own and two page-locked bounce buffers, so that copies into the bounce buffers
(host memory bandwidth, on the CPU's cores) overlap the DMA out of them (the
device's copy engine), and no one thread's Python sets the pace.

A chunk whose host bytes are page-locked already (this process's own staging
pool, pinned when it staged from a GPU) goes to the device straight, no bounce.
Any other (a restarted process's mapping of the pool, landing memory, a store
file's map) is copied into a bounce buffer piece by piece; a bounce buffer is
reused only after the DMA out of it finished (its event), so a piece is never
overwritten under a copy still reading it.

``hashed=True`` (a restore with ``atomic=False``) hashes each chunk on the way,
from the bounce buffer the device reads (page-locked bytes too go through one
then), so that the bytes verified are the bytes sent and the host bytes are read
once, not once to verify and once more to send.

The device side is a ``Lane`` (``cuda.CudaLane`` on a GPU); the tests drive the
same pipeline with a lane whose copies run later on a thread of their own, as a
DMA engine's do (``tests/unit/test_restore_h2d.py``)."""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import numpy as np
import torch

from ckptd import knobs
from ckptd.knobs import MiB

PIECE = 8 * MiB  # one bounce buffer by default (``knobs.h2d_piece``); two per thread
MAX_THREADS = 8


class Lane(Protocol):
    """One thread's way to a device: a stream of its own and two bounce buffers."""

    def active(self) -> AbstractContextManager[object]:
        """Entered once by the thread that uses the lane, around all its copies
        (a CUDA lane makes its device and stream current there)."""
        ...

    def direct(self, src: torch.Tensor) -> bool:
        """Whether ``src`` (host bytes) may be copied to the device as it is
        (page-locked: an asynchronous DMA)."""
        ...

    def bounce(self, k: int) -> torch.Tensor:
        """Bounce buffer ``k`` (0 or 1, at least the pieces' size, uint8), once the
        copy out of it that was sent last finished."""
        ...

    def send(self, dst: torch.Tensor, src: torch.Tensor, bounce: int | None = None) -> None:
        """Queues the copy ``dst <- src`` on the lane's stream (``bounce``: the bounce
        buffer ``src`` lies in, whose reuse then waits for this copy)."""
        ...

    def finish(self) -> None:
        """Blocks until every copy this lane sent finished."""
        ...


CopyJob = tuple[memoryview, torch.Tensor]  # (verified host bytes, uint8 device slice)


def _cuda_lane(device: torch.device, ready: Any, piece: int) -> Lane:
    from ..cuda import CudaLane  # only with CUDA tensors: no CUDA otherwise

    return CudaLane(device, ready, piece)


# Device type -> its lanes' maker (device, what the copies follow, piece size): the
# devices a restore copies into through ``copy_to_device``. Others (no streams to
# overlap) take a plain ``copy_``. The tests add a lane for the CPU, whose copies run
# late on a thread of their own as a DMA engine's do.
LANES: dict[str, Callable[[torch.device, Any, int], Lane]] = {"cuda": _cuda_lane}


def copy_to_device(jobs: Sequence[CopyJob], lane: Callable[[], Lane],
                   threads: int | None = None, inference: bool = False,
                   hashed: bool = False, piece: int | None = None) -> list[str] | None:
    """Copies each job's host bytes into its device slice, on ``threads`` threads
    (each opening its own ``lane()``, under ``no_grad`` and the caller's inference
    mode: both are per thread), and returns once every copy finished. The first
    error stops the others and is raised. ``hashed``: returns the blake3 hex digest
    of the bytes each job sent, in the jobs' order (hashed where the device read
    them). ``piece``: the bounce pieces' size (``PIECE`` by default)."""
    if not jobs:
        return [] if hashed else None
    piece = piece or PIECE
    threads = max(1, min(threads or MAX_THREADS, len(jobs)))
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))  # large ones first
    taken = iter(order)
    lock = threading.Lock()
    errors: list[BaseException] = []
    digests: list[str] = [""] * len(jobs) if hashed else []
    pinned = _PinnedCache()

    def next_job() -> int | None:
        with lock:
            i = next(taken, None)
        return None if i is None or errors else i

    def work() -> None:
        try:
            one = lane()
        except BaseException as exc:  # (no stream, no pinned memory)
            errors.append(exc)
            return
        k = 0
        try:
            with one.active(), torch.inference_mode(inference), torch.no_grad():
                while (i := next_job()) is not None:
                    src, dst = jobs[i]
                    hasher = blake3.blake3() if hashed else None
                    k = _copy_one(one, src, dst, k, piece, pinned, hasher)
                    if hasher is not None:
                        digests[i] = hasher.hexdigest()
        except BaseException as exc:
            errors.append(exc)
        finally:
            try:
                one.finish()
            except BaseException as exc:
                errors.append(exc)

    if threads == 1:
        work()
    else:
        pool = [threading.Thread(target=work, name=f"ckptd-h2d-{n}", daemon=True)
                for n in range(threads)]
        started = []
        try:
            for t in pool:
                t.start()
                started.append(t)
        except BaseException as exc:  # (no thread to be had): the started ones stop
            errors.append(exc)
            raise
        finally:
            for t in started:  # never return while a copy may still read or write
                t.join()
    if errors:
        raise errors[0]
    return digests if hashed else None


class _PinnedCache:
    """Whether a host buffer is page-locked, asked once per buffer object (a pool
    segment is pinned or not as a whole; asking CUDA costs a driver call)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[object, bool]] = {}
        self._lock = threading.Lock()

    def __call__(self, lane: Lane, src: memoryview, host: torch.Tensor) -> bool:
        owner = src.obj
        if owner is None:
            return lane.direct(host)
        with self._lock:  # (held while CUDA is asked: once per buffer)
            known = self._known.get(id(owner))
            if known is None or known[0] is not owner:
                known = self._known[id(owner)] = (owner, lane.direct(host))  # (kept alive)
            return known[1]


def _copy_one(lane: Lane, src: memoryview, dst: torch.Tensor, k: int, piece: int,
              pinned: _PinnedCache, hasher: blake3.blake3 | None = None) -> int:
    """One job through ``lane``; returns the bounce buffer to use next. ``hasher``
    is fed the bytes as the device reads them: each piece once it is sent, beside
    the DMA (both only read the buffer), one call per piece (hashing 512 KiB at a
    time as it is copied handed the GIL between the threads so often that it took
    twice as long on 16 cores, bench/RESULTS.md)."""
    n = len(src)
    if dst.numel() != n:
        raise ValueError(f"a device slice of {dst.numel()} bytes for {n} bytes")
    if n == 0:
        return k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about read-only pool maps
        host = torch.frombuffer(src, dtype=torch.uint8)
    # Hashed on the way: through a bounce buffer even when page-locked, since the
    # bytes hashed must be the bytes sent (a DMA where they lie reads them later).
    if hasher is None and pinned(lane, src, host):
        lane.send(dst, host)
        return k
    from_np = np.frombuffer(src, dtype=np.uint8)
    for a in range(0, n, piece):
        m = min(piece, n - a)
        buf = lane.bounce(k)
        staged = buf.numpy()[:m]
        np.copyto(staged, from_np[a : a + m])  # (no GIL while it copies)
        lane.send(dst[a : a + m], buf[:m], k)
        if hasher is not None:
            hasher.update(staged.data)  # the bytes the device reads, not the source's
        k ^= 1
    return k


@dataclass(frozen=True, slots=True)
class DeviceOrder:
    """What device copies made on another thread must follow, taken on the
    caller's thread (CUDA's current stream and inference mode are per thread):
    an event recorded on each device's current stream, and the inference mode."""

    ready: Mapping[torch.device, Any]
    inference: bool

    @classmethod
    def here(cls, devices: Iterable[torch.device]) -> DeviceOrder:
        """Taken now, on the calling thread (before the restore's own work)."""
        from ..cuda import record_ready  # only with device tensors: no CUDA otherwise

        cuda = [d for d in set(devices) if d.type == "cuda"]
        return cls(record_ready(cuda) if cuda else {}, torch.is_inference_mode_enabled())


def to_devices(found: Mapping[str, memoryview], devices: Mapping[str, list[torch.Tensor]],
               order: DeviceOrder | None = None, threads: int | None = None,
               hashed: bool = False) -> dict[str, str]:
    """Copies verified chunks from where they lie (the staging pool, the cache, a
    landing buffer) into device tensors: for a CUDA device on several threads, each
    with a side stream ordered after the work the caller had queued on the device's
    current stream (``order``; else this thread's) and its own page-locked bounce
    buffers (``devices.copy_to_device``); finished before returning (so the host
    bytes may go once this returns). ``hashed``: returns each chunk's blake3 as
    its CUDA slice read it (one slice per chunk)."""
    inference = order.inference if order is not None else torch.is_inference_mode_enabled()
    laned: dict[torch.device, list[tuple[str, CopyJob]]] = {}
    with torch.inference_mode(inference), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about read-only pool maps
        for cid, dsts in devices.items():
            for dst in dsts:
                if dst.device.type in LANES:
                    laned.setdefault(dst.device, []).append((cid, (found[cid], dst)))
                else:
                    dst.copy_(torch.frombuffer(found[cid], dtype=torch.uint8))
    if not laned:
        return {}
    ready = _ready(laned, order)
    threads = threads or knobs.h2d_threads()
    piece = knobs.h2d_piece()
    digests: dict[str, str] = {}
    for device, jobs in laned.items():
        lane = functools.partial(LANES[device.type], device, ready.get(device), piece)
        out = copy_to_device([job for _, job in jobs], lane, threads, inference, hashed, piece)
        if out is not None:
            digests.update(zip([cid for cid, _ in jobs], out, strict=True))
    return digests


def _ready(devices: Iterable[torch.device], order: DeviceOrder | None
           ) -> dict[torch.device, Any]:
    """What each device's copies follow: ``order``'s events, else an event
    recorded now on this thread's current stream of each CUDA device."""
    ready = dict(order.ready) if order is not None else {}
    cuda = [d for d in devices if d.type == "cuda" and d not in ready]
    if cuda:
        from ..cuda import record_ready  # only with CUDA tensors: no CUDA otherwise

        ready.update(record_ready(cuda))
    return ready


def from_scratch(on_device: Mapping[str, torch.Tensor],
                 devices: Mapping[str, list[torch.Tensor]],
                 order: DeviceOrder | None = None) -> None:
    """Copies chunks verified in device memory (``on_device``: chunk id -> its
    bytes there) into their slices of the target, device to device, on a stream
    of each device's lane (ordered as ``to_devices``'s copies); chunks that follow
    each other in both join into one copy. Finished before returning."""
    inference = order.inference if order is not None else torch.is_inference_mode_enabled()
    pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for cid, src in on_device.items():
        for dst in devices[cid]:
            pairs.setdefault(dst.device, []).append((dst, src))
    ready = _ready(pairs, order)
    for device, copies in pairs.items():
        joined = _joined(copies)  # (views made outside inference mode, as the target's)
        lane = LANES[device.type](device, ready.get(device), 0)
        try:
            with lane.active(), torch.inference_mode(inference), torch.no_grad():
                for dst, src in joined:
                    lane.send(dst, src)
        finally:
            lane.finish()


def _joined(copies: list[tuple[torch.Tensor, torch.Tensor]]
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` (uint8 destination, uint8 source), those that continue the last
    one in both storages joined into one."""
    def where(t: torch.Tensor) -> tuple[int, int]:
        return t.untyped_storage().data_ptr(), int(t.storage_offset())

    out: list[list[Any]] = []
    for dst, src in sorted(copies, key=lambda c: where(c[0])):
        if out:
            last = out[-1]  # [dst storage, dst offset, src storage, src offset, n, dst, src]
            (ds, do), (ss, so) = where(dst), where(src)
            if (ds, ss) == (last[0], last[2]) and do == last[1] + last[4] \
                    and so == last[3] + last[4] and dst.is_contiguous() and src.is_contiguous():
                last[4] += dst.numel()
                continue
        out.append([*where(dst), *where(src), dst.numel(), dst, src])
    joined: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _, do, _, so, n, dst, src in out:
        if n == dst.numel():
            joined.append((dst, src))
            continue
        whole_dst = dst.new_empty(0).set_(dst.untyped_storage(), do, (n,), (1,))
        whole_src = src.new_empty(0).set_(src.untyped_storage(), so, (n,), (1,))
        joined.append((whole_dst, whole_src))
    return joined
