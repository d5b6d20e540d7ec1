"""The host-to-device pipeline of a restore into CUDA tensors
(``restore.devices.copy_to_device``), driven on the CPU by a lane that behaves as
a GPU's does: a copy is queued and runs later on a thread of its own (the DMA
engine), reading its source only then. A pipeline that wrote a bounce buffer
again before the copy out of it ran would send the wrong bytes; one that returned
before every copy ran would leave the target short. (``CudaLane`` is the real
lane; tests/gpu runs it.)"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from ckptd.client.restore import devices
from ckptd.client.restore.devices import PIECE, copy_to_device


class LateLane:
    """A lane whose copies run late, one after the other, on a thread of their own;
    ``pinned``: the addresses of host memory it takes as page-locked."""

    lanes: list[LateLane] = []

    def __init__(self, pinned: frozenset[int] = frozenset(), fail_after: int | None = None
                 ) -> None:
        self.engine = concurrent.futures.ThreadPoolExecutor(1)
        self.buffers = [torch.empty(PIECE, dtype=torch.uint8) for _ in range(2)]
        self.sent: list[concurrent.futures.Future[None] | None] = [None, None]
        self.queued: list[concurrent.futures.Future[None]] = []
        self.pinned = pinned
        self.direct_copies = 0
        self.bounced = 0
        self.fail_after = fail_after
        self.grad_enabled: list[bool] = []
        LateLane.lanes.append(self)

    def direct(self, src: torch.Tensor) -> bool:
        return src.data_ptr() in self.pinned

    def bounce(self, k: int) -> torch.Tensor:
        sent = self.sent[k]
        if sent is not None:
            sent.result()
        return self.buffers[k]

    def send(self, dst: torch.Tensor, src: torch.Tensor, bounce: int | None = None) -> None:
        self.grad_enabled.append(torch.is_grad_enabled())
        if self.fail_after is not None and len(self.queued) >= self.fail_after:
            raise RuntimeError("CUDA error: an illegal memory access (a test's)")

        def dma() -> None:
            time.sleep(0.002)  # later than the host thread goes on
            dst.copy_(src)

        future = self.engine.submit(dma)
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


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "PIECE", 1000)  # many pieces per chunk: reuse is exercised
    LateLane.lanes = []


def chunks(sizes: list[int], seed: int = 0) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()
            for n in sizes]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_every_byte_arrives_through_reused_bounce_buffers(threads: int) -> None:
    data = chunks([4096, 10_000, 1, 0, 2500, 7777] * 3)
    target = torch.zeros(sum(map(len, data)), dtype=torch.uint8, requires_grad=False)
    jobs, at = [], 0
    for blob in data:
        jobs.append((memoryview(blob), target[at : at + len(blob)]))
        at += len(blob)
    copy_to_device(jobs, lambda: LateLane(), threads)
    assert bytes(target.numpy()) == b"".join(data)
    used = [lane for lane in LateLane.lanes if lane.queued]
    assert 1 <= len(used) <= threads and sum(lane.bounced for lane in used) > 2 * len(used)
    assert not any(g for lane in used for g in lane.grad_enabled)  # (no_grad per thread)


def test_page_locked_bytes_go_straight() -> None:
    data = chunks([3000, 5000], seed=1)
    src = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]
    pinned = frozenset({src[0].data_ptr()})
    target = torch.zeros(8000, dtype=torch.uint8)
    jobs = [(memoryview(src[0].numpy().data), target[:3000]),
            (memoryview(src[1].numpy().data), target[3000:])]
    copy_to_device(jobs, lambda: LateLane(pinned), 1)
    assert bytes(target.numpy()) == b"".join(data)
    (lane,) = LateLane.lanes
    assert lane.direct_copies == 1 and lane.bounced == 5


def test_a_failed_copy_is_raised_after_every_lane_finished() -> None:
    data = chunks([5000] * 8, seed=2)
    target = torch.zeros(40_000, dtype=torch.uint8)
    jobs = [(memoryview(b), target[i * 5000 : (i + 1) * 5000]) for i, b in enumerate(data)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        copy_to_device(jobs, lambda: LateLane(fail_after=3), 2)
    assert all(f.done() for lane in LateLane.lanes for f in lane.queued)
    assert threading.active_count() < 50  # (no thread left behind)


def test_a_slice_of_another_length_is_refused() -> None:
    target = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError):
        copy_to_device([(memoryview(b"x" * 11), target)], lambda: LateLane(), 1)
