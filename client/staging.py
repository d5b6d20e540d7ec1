"""Staging: the host copy of a rank's tensors that a snapshot uploads from.

``save()`` blocks the training loop only for this copy. Buffers are kept from one
save to the next (keyed by name, shape and dtype): copying into memory that is
already touched is about ten times faster than allocating fresh memory. Only one
snapshot per rank is in flight, so one set of buffers is enough; the pipeline
must be done with them before the next ``stage``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_Key = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True, slots=True)
class StagedTensor:
    """One tensor's staged copy: contiguous, on the CPU, owned by the staging area."""

    name: str
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass(frozen=True, slots=True)
class StagedState:
    """Every staged tensor of one save, and what the copy cost."""

    tensors: list[StagedTensor]
    nbytes: int
    seconds: float


class StagingArea:
    """Reusable host buffers that hold one staged copy of a rank's tensors."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> StagedState:
        """Copies every tensor into its staging buffer and returns the copies.

        Buffers of names that this save does not stage are freed, so staging holds
        at most one copy of the latest state."""
        start = time.perf_counter()
        staged: list[StagedTensor] = []
        with self._lock, torch.no_grad():
            kept: dict[_Key, torch.Tensor] = {}
            for name, tensor in tensors:
                key = (name, tuple(tensor.shape), tensor.dtype)
                buf = self._buffers.get(key)
                if buf is None:
                    buf = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu")
                buf.copy_(tensor.detach())
                kept[key] = buf
                staged.append(StagedTensor(name, buf))
            dropped = len(self._buffers.keys() - kept.keys())
            if dropped:
                log.debug("staging: freed %d buffers no longer in the state", dropped)
            self._buffers = kept
        nbytes = sum(s.nbytes for s in staged)
        return StagedState(staged, nbytes, time.perf_counter() - start)

    def clear(self) -> None:
        """Frees every buffer."""
        with self._lock:
            self._buffers = {}
