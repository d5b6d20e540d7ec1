"""A committed step as DCP sees it (``StepIndex``), built from its rank manifests
(never unpickled): the stored boxes of every tensor, the values, the opaque blobs,
DCP's object paths, and the live peers holding the step's chunks."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ckptd.format import RankManifest, TensorEntry

from .target import META_KEY

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredBox:
    """One stored shard: where its chunks are and what they hold."""

    entry: TensorEntry
    chunk_size: int


@dataclass(slots=True)
class StepIndex:
    """A committed step as DCP sees it, built from its manifests (never unpickled)."""

    step: int
    world_size: int
    boxes: dict[tuple[str, tuple[int, ...]], StoredBox] = field(default_factory=dict)
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    # Opaque blobs: the stored box of their bytes, and whether DCP wrote them (then
    # they go back to the planner as written; a Checkpointer's bytes leaf is a value).
    blobs: dict[str, tuple[StoredBox, bool]] = field(default_factory=dict)
    # Live peers holding each chunk (from the server's step plan) and the job's
    # peer token they require: the peer tier, as a Checkpointer's restore has it.
    peers: dict[str, list[str]] = field(default_factory=dict)
    peer_token: str | None = None


def index_manifest(index: StepIndex, manifest: RankManifest) -> None:
    """Adds one rank manifest's boxes and values to the index.

    A DCP-written manifest has a flat tree ``{fqn: node}``; another (a
    ``Checkpointer`` save) is walked as DCP flattens a state dict, so its dotted
    tensor names are DCP's fully qualified names."""
    # (format 1.3: a rank may hold several shards of one tensor, entries of one name)
    entries: dict[str, list[TensorEntry]] = {}
    for e in manifest.entries:
        entries.setdefault(e.name, []).append(e)
    dcp_meta = manifest.meta.get(META_KEY)
    leaves: list[tuple[str, tuple[str | int, ...], dict[str, Any]]] = []
    if isinstance(dcp_meta, dict):
        paths = dcp_meta.get("paths") or {}
        for fqn, node in manifest.tree.get("dict", []):
            path = paths.get(fqn)
            leaves.append((str(fqn), tuple(path) if isinstance(path, list) else (str(fqn),), node))
    else:
        _walk_tree(manifest.tree, (), leaves)
    for fqn, path, node in leaves:
        index.paths.setdefault(fqn, path)
        if set(node) == {"bytes"}:
            index.blobs.setdefault(fqn, (StoredBox(entries[node["bytes"]][0],
                                                    manifest.chunk_size),
                                         isinstance(dcp_meta, dict)))
            continue
        if set(node) != {"tensor"}:
            index.values.setdefault(fqn, node)  # replicas of a value: the lowest rank's
            continue
        for e in entries[node["tensor"]]:
            if e.placement == "local" and manifest.world_size > 1:
                log.debug("skipping rank-local entry %r of rank %d", e.name, manifest.rank)
                continue
            # Replicated entries and HSDP replicas share a box: one is enough to read.
            index.boxes.setdefault((fqn, tuple(e.offsets)), StoredBox(e, manifest.chunk_size))


def _walk_tree(
    node: dict[str, Any],
    path: tuple[str | int, ...],
    leaves: list[tuple[str, tuple[str | int, ...], dict[str, Any]]],
) -> None:
    """DCP's traversal of a state dict, over a tree: mappings are always entered,
    lists only when they hold a tensor or a mapping; everything else is a leaf."""
    ((kind, body),) = node.items()
    if kind == "dict":
        for key, child in body:
            _walk_tree(child, (*path, str(key)), leaves)
    elif kind in ("list", "tuple") and _holds_tensor_or_dict(node):
        for i, child in enumerate(body):
            _walk_tree(child, (*path, i), leaves)
    elif path:
        leaves.append((".".join(map(str, path)), path, node))


def _holds_tensor_or_dict(node: dict[str, Any]) -> bool:
    ((kind, body),) = node.items()
    if kind in ("tensor", "dict"):
        return True
    if kind in ("list", "tuple"):
        return any(_holds_tensor_or_dict(child) for child in body)
    return False
