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
from the bounce buffer the device reads (or the page-locked bytes it reads), so
that the bytes verified are the bytes sent and the host bytes are read once, not
once to verify and once more to send.

The device side is a ``Lane`` (``cuda.CudaLane`` on a GPU); the tests drive the
same pipeline with a lane whose copies run later on a thread of their own, as a
DMA engine's do (``tests/unit/test_restore_h2d.py``)."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
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
                   hashed: bool = False, piece: int | None = None,
                   hash_piece: int | None = None) -> list[str] | None:
    """Copies each job's host bytes into its device slice, on ``threads`` threads
    (each opening its own ``lane()``, under ``no_grad`` and the caller's inference
    mode: both are per thread), and returns once every copy finished. The first
    error stops the others and is raised. ``hashed``: returns the blake3 hex digest
    of the bytes each job sent, in the jobs' order (hashed where the device read
    them). ``piece``: the bounce pieces' size (``PIECE`` by default);
    ``hash_piece``: see ``_copy_one`` (``knobs.h2d_hash_piece`` by default)."""
    if not jobs:
        return [] if hashed else None
    piece = piece or PIECE
    hash_piece = knobs.h2d_hash_piece() if hash_piece is None else hash_piece
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
                    k = _copy_one(one, src, dst, k, piece, pinned, hasher, hash_piece)
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
              pinned: Callable[[Lane, memoryview, torch.Tensor], bool] | None = None,
              hasher: blake3.blake3 | None = None, hash_piece: int = 0) -> int:
    """One job through ``lane``; returns the bounce buffer to use next. ``hasher``
    is fed the bytes as the device reads them (``hash_piece`` at a time as they
    are copied; 0: each piece once it is sent)."""
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
    if hasher is None and (pinned or _ask)(lane, src, host):
        lane.send(dst, host)
        return k
    from_np = np.frombuffer(src, dtype=np.uint8)
    for a in range(0, n, piece):
        m = min(piece, n - a)
        buf = lane.bounce(k)
        staged = buf.numpy()[:m]
        bits = hash_piece or m
        if hasher is None or bits >= m:
            np.copyto(staged, from_np[a : a + m])  # (no GIL while it copies)
        else:  # each bit hashed while it is still in the core's cache
            for b in range(0, m, bits):
                bit = staged[b : b + bits]
                np.copyto(bit, from_np[a + b : a + b + len(bit)])
                hasher.update(bit.data)  # the bytes the device will read, not the source's
        lane.send(dst[a : a + m], buf[:m], k)
        if hasher is not None and bits >= m:
            # After the send, beside the DMA (both only read the buffer): one call per
            # piece, since each call is a hand-off of the GIL between the threads.
            hasher.update(staged.data)
        k ^= 1
    return k


def _ask(lane: Lane, src: memoryview, host: torch.Tensor) -> bool:
    return lane.direct(host)


def no_context() -> AbstractContextManager[object]:
    """``Lane.active`` of a lane that needs nothing made current."""
    return contextlib.nullcontext()
