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

The device side is a ``Lane`` (``cuda.CudaLane`` on a GPU); the tests drive the
same pipeline with a lane whose copies run later on a thread of their own, as a
DMA engine's do (``tests/unit/test_restore_h2d.py``)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from ckptd.knobs import MiB

PIECE = 8 * MiB  # one bounce buffer; two per thread
MAX_THREADS = 8


class Lane(Protocol):
    """One thread's way to a device: a stream of its own and two bounce buffers."""

    def direct(self, src: torch.Tensor) -> bool:
        """Whether ``src`` (host bytes) may be copied to the device as it is
        (page-locked: an asynchronous DMA)."""
        ...

    def bounce(self, k: int) -> torch.Tensor:
        """Bounce buffer ``k`` (0 or 1, ``PIECE`` bytes, uint8), once the copy out of
        it that was sent last finished."""
        ...

    def send(self, dst: torch.Tensor, src: torch.Tensor, bounce: int | None = None) -> None:
        """Queues the copy ``dst <- src`` on the lane's stream (``bounce``: the bounce
        buffer ``src`` lies in, whose reuse then waits for this copy)."""
        ...

    def finish(self) -> None:
        """Blocks until every copy this lane sent finished."""
        ...


CopyJob = tuple[memoryview, torch.Tensor]  # (verified host bytes, uint8 device slice)


def copy_to_device(jobs: Sequence[CopyJob], lane: Callable[[], Lane],
                   threads: int | None = None, inference: bool = False) -> None:
    """Copies each job's host bytes into its device slice, on ``threads`` threads
    (each opening its own ``lane()``, under ``no_grad`` and the caller's inference
    mode: both are per thread), and returns once every copy finished. The first
    error stops the others and is raised."""
    if not jobs:
        return
    threads = max(1, min(threads or MAX_THREADS, len(jobs)))
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))  # large ones first
    taken = iter(order)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def next_job() -> CopyJob | None:
        with lock:
            i = next(taken, None)
        return None if i is None or errors else jobs[i]

    def work() -> None:
        try:
            one = lane()
        except BaseException as exc:  # (no stream, no pinned memory)
            errors.append(exc)
            return
        k = 0
        try:
            with torch.inference_mode(inference), torch.no_grad():
                while (job := next_job()) is not None:
                    k = _copy_one(one, *job, k)
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
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    if errors:
        raise errors[0]


def _copy_one(lane: Lane, src: memoryview, dst: torch.Tensor, k: int) -> int:
    """One job through ``lane``; returns the bounce buffer to use next."""
    n = len(src)
    if dst.numel() != n:
        raise ValueError(f"a device slice of {dst.numel()} bytes for {n} bytes")
    if n == 0:
        return k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about read-only pool maps
        host = torch.frombuffer(src, dtype=torch.uint8)
    if lane.direct(host):
        lane.send(dst, host)
        return k
    from_np = np.frombuffer(src, dtype=np.uint8)
    for a in range(0, n, PIECE):
        m = min(PIECE, n - a)
        buf = lane.bounce(k)
        np.copyto(buf.numpy()[:m], from_np[a : a + m])  # (no GIL while it copies)
        lane.send(dst[a : a + m], buf[:m], k)
        k ^= 1
    return k
