"""The host-to-device pipeline of a restore into CUDA tensors
(``restore.devices.copy_to_device``), driven on the CPU by a lane that behaves as
a GPU's does: a copy is queued and runs later on a thread of its own (the DMA
engine), reading its source only then. A pipeline that wrote a bounce buffer
again before the copy out of it ran would send the wrong bytes; one that returned
before every copy ran would leave the target short. (``CudaLane`` is the real
lane; tests/gpu runs it.)"""

from __future__ import annotations

import threading

import blake3
import pytest
import torch

from ckptd.client.restore import devices
from ckptd.client.restore.devices import copy_to_device
from tests.late_lane import LateLane


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


@pytest.mark.parametrize("threads", [1, 3])
def test_hashed_copies_give_each_chunks_blake3(threads: int) -> None:
    """``atomic=False`` hashes each chunk from the bounce buffers the device reads:
    the digests must be those of the bytes, whatever the pieces and threads."""
    data = chunks([4096, 10_000, 1, 0, 2500, 7777, 999], seed=3)
    target = torch.zeros(sum(map(len, data)), dtype=torch.uint8)
    jobs, at = [], 0
    for blob in data:
        jobs.append((memoryview(blob), target[at : at + len(blob)]))
        at += len(blob)
    digests = copy_to_device(jobs, lambda: LateLane(), threads, hashed=True)
    assert digests == [blake3.blake3(b).hexdigest() for b in data]
    assert bytes(target.numpy()) == b"".join(data)


def test_hashed_page_locked_bytes_still_go_through_a_bounce_buffer() -> None:
    """A DMA straight from page-locked bytes reads them later than a hash would:
    hashed on the way, the bytes are sent from the buffer they were hashed in."""
    data = chunks([3000, 5000], seed=4)
    src = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]
    pinned = frozenset({src[0].data_ptr()})
    target = torch.zeros(8000, dtype=torch.uint8)
    jobs = [(memoryview(src[0].numpy().data), target[:3000]),
            (memoryview(src[1].numpy().data), target[3000:])]
    digests = copy_to_device(jobs, lambda: LateLane(pinned), 1, hashed=True)
    assert digests == [blake3.blake3(b).hexdigest() for b in data]
    assert bytes(target.numpy()) == b"".join(data)
    (lane,) = LateLane.lanes
    assert lane.direct_copies == 0 and lane.bounced == 8


def test_a_thread_that_cannot_start_stops_the_copies_before_the_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy may still run (reading a pool map, writing the target) once
    ``copy_to_device`` has raised."""
    data = chunks([5000] * 8, seed=6)
    target = torch.zeros(40_000, dtype=torch.uint8)
    jobs = [(memoryview(b), target[i * 5000 : (i + 1) * 5000]) for i, b in enumerate(data)]
    real_start = threading.Thread.start
    starts = [0]

    def start(self: threading.Thread) -> None:
        if self.name.startswith("ckptd-h2d-"):  # (not the lanes' own engine threads)
            starts[0] += 1
            if starts[0] == 3:
                raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        copy_to_device(jobs, lambda: LateLane(), 4)
    assert not any(t.name.startswith("ckptd-h2d-") for t in threading.enumerate())
    assert all(f.done() for lane in LateLane.lanes for f in lane.queued)


def test_whether_memory_is_page_locked_is_asked_once_per_buffer() -> None:
    """Asking CUDA costs a driver call: slices of one mapping (a pool segment) ask
    once, whatever the number of chunks in it."""
    whole = bytearray(chunks([40_000], seed=5)[0])
    view = memoryview(whole)
    target = torch.zeros(40_000, dtype=torch.uint8)
    jobs = [(view[a : a + 4000], target[a : a + 4000]) for a in range(0, 40_000, 4000)]
    copy_to_device(jobs, lambda: LateLane(), 2)
    assert bytes(target.numpy()) == bytes(whole)
    assert sum(lane.asked for lane in LateLane.lanes) == 1
