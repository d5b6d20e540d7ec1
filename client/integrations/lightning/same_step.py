"""A second save at a step the plugin stored or loaded already: Lightning saves one
step under several names (a top-k file, then ``last.ckpt``), and a step is stored
once, so a later name only tags it, when its tensors hold the stored bytes.

Cheapest first. A tensor whose identity and version (``data_ptr``, ``_version``)
are the stored one's is the same, with no read: Lightning's own saves hand the
model's tensors each time. Where they differ (a tensor ``on_save_checkpoint``
makes anew at each save, ``AsyncCheckpointIO``'s clones, FSDP's gathered full
state dict), the bytes are compared: with the first save's tensor itself where
the plugin kept it (it keeps a reference to the small ones, up to ``KEEP_BYTES``
each, never a copy), else by hash with the stored step's manifest, read once
after its commit (a small document): each such tensor's chunks are hashed as a
save hashes them, one tensor at a time on the CPU, and compared with the chunk
ids the manifest names. No second copy of the step is made. Only a tensor the
manifest cannot speak for (one the flattened state names apart, a shard) is
compared with the stored step read back from this node's staging pool. The
second save waits for the first one's upload (under ``AsyncCheckpointIO``, in
its thread, not the training loop's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import CkptdError
from ckptd.format import RankManifest, TensorEntry
from ckptd.hashing import chunk_id, chunk_spans

from ...dtypes import byte_view, dtype_name
from ...save.flatten import flatten
from ...save.handle import SaveHandle

KEEP_BYTES = 64 * 1024  # a tensor of at most this many bytes is kept by reference
KEEP_TOTAL = 16 * 1024 * 1024  # and at most this many bytes of them in all


def tensors_of(state: Any) -> dict[str, torch.Tensor]:
    """Each tensor of ``state`` by its path in it."""
    out: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, Mapping):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")

    walk(state, "")
    return out


def _identity(x: torch.Tensor) -> tuple[Any, ...]:
    """Equal identities mean the same tensor, unchanged in place in between
    (``_version`` counts in-place changes)."""
    return (x.data_ptr(), x._version, tuple(x.shape), x.dtype, x.device)


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.detach().cpu().reshape(-1).view(torch.uint8),
                       y.detach().cpu().reshape(-1).view(torch.uint8))


@dataclass(slots=True)
class Saved:
    """The last step this plugin stored or restored, and how (for a second save at it)."""

    step: int
    path: str
    handle: SaveHandle | None  # None: restored, committed long since
    identities: dict[str, tuple[Any, ...]] | None  # None: restored (compared by bytes)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # small ones, by reference
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)  # (pointers.py)

    @classmethod
    def stored(cls, step: int, path: str, handle: SaveHandle, checkpoint: Any,
               callbacks: dict[str, dict[str, Any]]) -> Saved:
        tensors = tensors_of(checkpoint)
        kept: dict[str, torch.Tensor] = {}
        total = 0
        for k, x in tensors.items():
            size = x.numel() * x.element_size()
            if size <= KEEP_BYTES and total + size <= KEEP_TOTAL:
                kept[k] = x
                total += size
        return cls(step, path, handle, {k: _identity(x) for k, x in tensors.items()},
                   kept, callbacks)

    def changed(self, checkpoint: Any, read_back: Callable[[], Mapping[str, Any]],
                manifest: Callable[[], RankManifest] | None = None) -> list[str]:
        """The paths of ``checkpoint``'s tensors whose bytes are not the stored
        step's (or that one of them lacks); ``manifest()`` gives the stored step's
        manifest, asked when identity and the kept tensors cannot tell, and
        ``read_back()`` the stored step, asked for what the manifest cannot tell."""
        now = tensors_of(checkpoint)
        if self.identities is None:
            return _differing(now, tensors_of(read_back()), list(now))
        changed = [k for k in self.identities if k not in now]
        unsure: list[str] = []
        for k, x in now.items():
            then = self.identities.get(k)
            if then is None:
                changed.append(k)
            elif _identity(x) == then:
                continue
            elif k in self.kept and _identity(self.kept[k]) == then:
                if not _same_bytes(x, self.kept[k]):
                    changed.append(k)
            else:
                unsure.append(k)
        if unsure and not changed and manifest is not None:
            changed, unsure = _by_hash(checkpoint, now, unsure, manifest())
        if unsure and not changed:
            changed = _differing(now, tensors_of(read_back()), unsure)
        return changed


def _by_hash(checkpoint: Any, now: Mapping[str, torch.Tensor], paths: list[str],
             manifest: RankManifest) -> tuple[list[str], list[str]]:
    """Of ``paths``: those whose bytes are not the ones ``manifest`` names (compared
    by chunk hash), and those it cannot speak for (to be read back)."""
    try:
        named = {id(t): name for name, t in flatten(checkpoint).tensors}
    except CkptdError:  # (a state the save refuses: read back, and said there)
        return [], paths
    entries = {e.name: e for e in manifest.entries}
    differ: list[str] = []
    unknown: list[str] = []
    for k in paths:
        entry = entries.get(named.get(id(now[k]), ""))
        if entry is None or entry.shape != entry.global_shape or any(entry.offsets):
            unknown.append(k)
        elif not _hashes_match(now[k], entry, manifest.chunk_size):
            differ.append(k)
    return differ, unknown


def _hashes_match(x: torch.Tensor, entry: TensorEntry, chunk_size: int) -> bool:
    """Whether ``x`` holds the bytes ``entry`` names: its dtype, shape and each
    chunk's hash, as a save computes them."""
    if dtype_name(x.dtype) != entry.dtype or list(x.shape) != entry.shape:
        return False
    data = byte_view(x.detach().cpu().contiguous())
    if len(data) != entry.nbytes:
        return False
    spans = list(chunk_spans(entry.nbytes, chunk_size))
    return len(spans) == len(entry.chunks) and all(
        chunk_id(data[a:b]) == cid for (a, b), cid in zip(spans, entry.chunks, strict=True))


def _differing(now: Mapping[str, torch.Tensor], stored: Mapping[str, torch.Tensor],
               paths: list[str]) -> list[str]:
    """Of ``paths``, those whose tensor in ``now`` is not bitwise ``stored``'s (and,
    comparing all, those in one of them only)."""
    out = [k for k in stored if k not in now] if len(paths) == len(now) else []
    for k in paths:
        y = stored.get(k)
        if y is None or not _same_bytes(now[k], y):
            out.append(k)
    return out
