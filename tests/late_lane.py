"""A ``restore.devices.Lane`` for the CPU that behaves as a GPU's does: a copy is
queued and runs later on a thread of its own (the DMA engine), reading its source
only then. The tests drive the host-to-device pipeline with it where no GPU is
(``CudaLane`` is the real lane; tests/gpu runs it)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator

import torch

from ckptd.client.restore.devices import PIECE


class LateLane:
    """A lane whose copies run late, one after the other, on a thread of their own;
    ``pinned``: the addresses of host memory it takes as page-locked."""

    lanes: list[LateLane] = []

    def __init__(self, pinned: frozenset[int] = frozenset(), fail_after: int | None = None,
                 piece: int = PIECE) -> None:
        self.engine = concurrent.futures.ThreadPoolExecutor(1)
        self.buffers = [torch.empty(piece, dtype=torch.uint8) for _ in range(2)]
        self.sent: list[concurrent.futures.Future[None] | None] = [None, None]
        self.queued: list[concurrent.futures.Future[None]] = []
        self.pinned = pinned
        self.direct_copies = 0
        self.bounced = 0
        self.fail_after = fail_after
        self.grad_enabled: list[bool] = []
        self.asked = 0
        self.bytes_sent = 0
        self.inside = False
        LateLane.lanes.append(self)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def direct(self, src: torch.Tensor) -> bool:
        self.asked += 1
        return src.data_ptr() in self.pinned

    def bounce(self, k: int) -> torch.Tensor:
        sent = self.sent[k]
        if sent is not None:
            sent.result()
        return self.buffers[k]

    def send(self, dst: torch.Tensor, src: torch.Tensor, bounce: int | None = None) -> None:
        assert self.inside, "a copy sent outside the lane's active()"
        self.grad_enabled.append(torch.is_grad_enabled())
        if self.fail_after is not None and len(self.queued) >= self.fail_after:
            raise RuntimeError("CUDA error: an illegal memory access (a test's)")

        def dma() -> None:
            time.sleep(0.002)  # later than the host thread goes on
            dst.copy_(src)

        future = self.engine.submit(dma)
        self.bytes_sent += src.numel()
        self.queued.append(future)
        if bounce is None:
            self.direct_copies += 1
        else:
            self.bounced += 1
            self.sent[bounce] = future

    def finish(self) -> None:
        for future in self.queued:
            future.result()
        self.engine.shutdown()
