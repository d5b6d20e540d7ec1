"""A committed step as a zarr v3 hierarchy: groups, arrays and their metadata.

Pure: from rank manifests to the zarr documents (``zarr.json``) and each array's
grid; no I/O and no zarr import. The state dict's dicts, lists and tuples become
groups, its tensors arrays (global shape, sharded tensors assembled from their
boxes, replicas once), its other leaves attributes of their group. The root's
``ckptd`` attribute keeps the exact tree, so an import gives the state back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ckptd import dtypes
from ckptd.errors import InvalidDocument
from ckptd.format import RankManifest, TensorEntry
from ckptd.zarr.grid import Box, Grid, choose_grid, chunk_indices

ATTR: Final = "ckptd"  # the attribute holding ckptd's own description of a node

# ckptd dtype -> (zarr v3 data_type, fill value). zarr-python 3.1 has no bfloat16
# or float8 in its dtype registry, so those are their raw bits as same-width
# unsigned integers; the array's ``ckptd.dtype`` attribute names the real type
# (ml_dtypes.bfloat16 etc. read them: ``a.view(ml_dtypes.bfloat16)``).
ZARR_DTYPES: Final[dict[str, tuple[str, Any]]] = {
    "float64": ("float64", 0.0),
    "float32": ("float32", 0.0),
    "float16": ("float16", 0.0),
    "bfloat16": ("uint16", 0),
    "int64": ("int64", 0),
    "int32": ("int32", 0),
    "int16": ("int16", 0),
    "int8": ("int8", 0),
    "uint8": ("uint8", 0),
    "uint16": ("uint16", 0),
    "uint32": ("uint32", 0),
    "uint64": ("uint64", 0),
    "bool": ("bool", False),
    "complex64": ("complex64", [0.0, 0.0]),
    "complex128": ("complex128", [0.0, 0.0]),
    "float8_e4m3fn": ("uint8", 0),
    "float8_e5m2": ("uint8", 0),
    "float8_e4m3fnuz": ("uint8", 0),
    "float8_e5m2fnuz": ("uint8", 0),
    "float8_e8m0fnu": ("uint8", 0),
    "float4_e2m1fn_x2": ("uint8", 0),  # each byte two fp4 values, as torch packs them
}
RAW_DTYPES: Final = frozenset(k for k, (v, _) in ZARR_DTYPES.items() if k != v)
_RESERVED: Final = {"": "%", ".": "%2E", "..": "%2E%2E", "zarr.json": "zarr%2Ejson"}
_FLOAT_ATTRS: Final = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


@dataclass(frozen=True, slots=True)
class ArrayNode:
    path: str
    name: str  # the ckptd entry name
    dtype: str  # the ckptd dtype name
    placement: str
    grid: Grid


@dataclass(slots=True)
class GroupNode:
    path: str
    attributes: dict[str, Any] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Hierarchy:
    """Every node of the view by its zarr path ('' is the root group)."""

    groups: dict[str, GroupNode]
    arrays: dict[str, ArrayNode]

    def metadata(self, path: str) -> dict[str, Any] | None:
        if path in self.arrays:
            return array_metadata(self.arrays[path])
        if path in self.groups:
            return {"zarr_format": 3, "node_type": "group",
                    "attributes": self.groups[path].attributes}
        return None

    def store_keys(self) -> Iterator[str]:
        """Every key of the view: metadata documents and chunk keys."""
        for path in self.groups:
            yield join(path, "zarr.json")
        for path, node in self.arrays.items():
            yield join(path, "zarr.json")
            for index in chunk_indices(node.grid):
                yield chunk_key(path, index)


def join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def chunk_key(path: str, index: Sequence[int]) -> str:
    """The default v3 chunk key ("c/0/1"; "c" for a 0-dimensional array)."""
    return join(path, "/".join(["c", *map(str, index)]))


def node_name(key: str | int) -> str:
    """A state-dict key as a zarr node name: '/' and '%' escaped as %2F and %25,
    and the names zarr reserves ('', '.', '..', '__*', 'zarr.json') escaped too."""
    s = str(key).replace("%", "%25").replace("/", "%2F")
    if s in _RESERVED:
        return _RESERVED[s]
    if s.startswith("__"):
        return "%5F" + s[1:]
    return s


def array_metadata(node: ArrayNode) -> dict[str, Any]:
    data_type, fill = ZARR_DTYPES[node.dtype]
    codec: dict[str, Any] = {"name": "bytes"}
    if dtypes.itemsize(node.dtype) > 1:
        codec["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(node.grid.shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": list(node.grid.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [codec],
        "attributes": {ATTR: {"name": node.name, "dtype": node.dtype,
                              "placement": node.placement}},
        "storage_transformers": [],
    }


def merge_trees(trees: Sequence[Any]) -> Any:
    """One tree for the step: the first rank's, plus what only later ranks hold
    (a pipeline stage's tensors, say), dict by dict."""
    merged = trees[0]
    for tree in trees[1:]:
        merged = _merge(merged, tree)
    return merged


def _merge(a: Any, b: Any) -> Any:
    if "dict" not in a or "dict" not in b:
        return a
    items = [list(p) for p in a["dict"]]
    where = {(type(k), k): i for i, (k, _) in enumerate(items)}
    for key, node in b["dict"]:
        i = where.get((type(key), key))
        if i is None:
            items.append([key, node])
        else:
            items[i][1] = _merge(items[i][1], node)
    return {"dict": items}


def build(manifests: Sequence[RankManifest]) -> Hierarchy:
    """The view of a committed step from its rank manifests (rank order)."""
    first = manifests[0]
    by_name: dict[str, list[tuple[int, TensorEntry]]] = {}
    for m in manifests:
        for e in m.entries:
            by_name.setdefault(e.name, []).append((m.rank, e))
    tree = merge_trees([m.tree for m in manifests])
    groups: dict[str, GroupNode] = {}
    arrays: dict[str, ArrayNode] = {}
    paths: dict[str, str] = {}

    def array(path: str, name: str) -> None:
        held = by_name[name]
        kinds = {e.placement for _, e in held}
        if "local" in kinds:  # rank-local: the lowest rank's, never assembled
            entries = [held[0][1]]
        else:
            seen: dict[tuple[tuple[int, ...], tuple[int, ...]], TensorEntry] = {}
            for _, e in held:
                seen.setdefault((tuple(e.offsets), tuple(e.shape)), e)
            entries = list(seen.values())
        e0 = entries[0]
        if e0.dtype not in ZARR_DTYPES:
            raise InvalidDocument(f"entry {name!r} has dtype {e0.dtype!r}, unknown to the view")
        boxes = [Box(tuple(e.offsets), tuple(e.shape), tuple(e.chunks)) for e in entries]
        grid = choose_grid(e0.global_shape, dtypes.itemsize(e0.dtype), first.chunk_size, boxes)
        arrays[path] = ArrayNode(path, name, e0.dtype, e0.placement, grid)
        paths[name] = path

    def walk(path: str, node: dict[str, Any]) -> None:
        group = groups.setdefault(path, GroupNode(path))
        ((kind, body),) = node.items()
        pairs = body if kind == "dict" else list(enumerate(body))
        if kind != "dict":
            group.attributes[ATTR] = {"kind": kind}
        used: set[str] = set(group.children)
        for key, child in pairs:
            name = node_name(key)
            if name in used:  # 1 and "1" in one dict
                name = f"{name}%i"
            ((ckind, cbody),) = child.items()
            if ckind == "value":
                group.attributes[name] = cbody
            elif ckind == "float":
                group.attributes[name] = _FLOAT_ATTRS[cbody]
            elif ckind in ("tensor", "bytes"):  # (a blob: its 1-D uint8 entry)
                used.add(name)
                group.children.append(name)
                array(join(path, name), cbody)
            else:
                used.add(name)
                group.children.append(name)
                walk(join(path, name), child)

    if "dict" not in tree:
        raise InvalidDocument("the step's tree is not a dict at its root")
    walk("", tree)
    groups[""].attributes[ATTR] = {
        "job": first.job,
        "step": first.step,
        "world_size": first.world_size,
        "chunk_size": first.chunk_size,
        "tree": tree,
        "arrays": paths,
    }
    return Hierarchy(groups, arrays)


def shared_chunks(a: ArrayNode, b: ArrayNode) -> tuple[int, int]:
    """(chunks of ``b`` whose id ``a`` also holds, chunks of ``b``)."""
    ids_a = {cid for box in a.grid.boxes for cid in box.chunks}
    ids_b = [cid for box in b.grid.boxes for cid in box.chunks]
    return sum(1 for cid in ids_b if cid in ids_a), len(ids_b)


def logical_nbytes(node: ArrayNode) -> int:
    return math.prod(node.grid.shape) * node.grid.itemsize
