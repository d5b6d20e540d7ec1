"""What a safetensors export holds and where (pure: no torch, no I/O).

The global tensors of a committed step (``global_tensors``: every distinct box of
each, from any world size), the files they go in (``plan_files``: Hugging Face's
greedy split by ``max_shard_size`` and its file names), and each file's header,
laid out as ``safetensors.torch.save_file`` lays out the same tensors: the
``__metadata__`` first, tensors ordered by dtype alignment (widest first) then
name, data offsets contiguous from 0, the JSON padded with spaces to 8 bytes.
The same tensors and metadata give the same bytes as ``save_file``.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from ckptd.dtypes import itemsize
from ckptd.errors import InvalidRequest, UnsupportedValue
from ckptd.format import RankManifest, TensorEntry

# ckptd dtype name -> safetensors dtype; in safetensors' own order of its dtype
# enum, narrowest first: a file lays tensors out widest first (then by name), so
# every tensor starts aligned to its element size.
SAFETENSORS_DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "float4_e2m1fn_x2": "F4",  # (its shape counts fp4 values: ``header_shape``)
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}
CKPTD_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
# ckptd dtype -> values per byte where one element holds several: a safetensors
# shape counts values, ckptd's (as torch's) the bytes, so the last dimension differs.
PACKED_DTYPES: dict[str, int] = {"float4_e2m1fn_x2": 2}
_RANK = {name: i for i, name in enumerate(SAFETENSORS_DTYPES)}

# A file's ``__metadata__`` key holding, for each of its tensors, its place in the
# state ckptd saved (JSON: {name: path}, in state-dict order; a path is a list of
# keys, a str or int a mapping's key, [i] a list's item i): absent when every
# tensor of the file was at the top of the state under the name it has in the file.
# The import puts the tensors back there, so an exported step imports as it was.
PATHS_KEY = "ckptd.paths"
# The manifest ``meta`` key where an import keeps its files' other ``__metadata__``;
# an export of that step writes it back into its files' ``__metadata__``.
METADATA_META = "safetensors_metadata"

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's default, "5GB"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A header larger than this is refused by safetensors' reader (100 MB).
MAX_HEADER = 100_000_000

Box = tuple[tuple[int, ...], tuple[int, ...]]

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str | int | float, name: str = "max_shard_size") -> int:
    """``5GB`` (Hugging Face's decimal units: 5 x 10^9), ``500MB``, ``2GiB`` (binary),
    or a number of bytes (``1.5e9`` too): a whole number of them, more than 0.
    ``name``: what the caller called it (the argument; the CLI's option)."""
    said = f"{name} {text!r}"
    if isinstance(text, str):
        m = _SIZE.fullmatch(text)
        if m is None:
            raise InvalidRequest(f"{said} is not a size: write it like 5GB, 500MB, 2GiB or "
                                 "a number of bytes")
        exact = Fraction(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    elif isinstance(text, numbers.Real) and not isinstance(text, bool) and \
            math.isfinite(text):
        # (numpy's float32 / float16 are Reals that Fraction does not take: as float)
        exact = Fraction(text if isinstance(text, numbers.Integral) else float(text))
    else:
        raise InvalidRequest(f"{said} is not a size: give a number of bytes or a string "
                             "like 5GB, 500MB, 2GiB")
    if exact.denominator != 1:
        raise InvalidRequest(f"{said} is not a whole number of bytes ({float(exact)}); "
                             "round it")
    if exact <= 0:
        raise InvalidRequest(f"{name} must be more than 0 bytes, not {text!r}")
    return int(exact)


@dataclass(frozen=True, slots=True)
class StoredBox:
    """One distinct stored box of a global tensor: the entry holding it."""

    entry: TensorEntry
    chunk_size: int


@dataclass(slots=True)
class GlobalTensor:
    """One tensor of the export: its name in the files, the step's entry name,
    dtype, global shape and the distinct stored boxes that tile it."""

    name: str
    source: str
    dtype: str
    shape: tuple[int, ...]
    boxes: list[StoredBox] = field(default_factory=list)
    path: list[object] | None = None  # its place in the state (PATHS_KEY), if known

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def contiguous(self) -> bool:
        """Whether every box is one run of the tensor's C-order bytes (whole rows
        of the leading dimensions): then the tensor's bytes are its boxes' chunks
        in order, and each chunk goes straight to its place in the file."""
        return all(box_is_run(b.entry.offsets, b.entry.shape, self.shape) for b in self.boxes)


def box_is_run(offsets: Sequence[int], shape: Sequence[int], global_shape: Sequence[int]
               ) -> bool:
    """Whether a box's elements are consecutive in C order: after its first
    dimension of more than one element, it spans every later dimension whole."""
    if math.prod(shape) == 0:
        return True
    partial = False
    for s, g in zip(shape, global_shape, strict=True):
        if partial and s != g:
            return False
        if s > 1:
            partial = True
    return True


def run_start(offsets: Sequence[int], global_shape: Sequence[int]) -> int:
    """The element index (C order) of a box's first element."""
    index = 0
    for o, g in zip(offsets, global_shape, strict=True):
        index = index * g + o
    return index


@dataclass(frozen=True, slots=True)
class Selection:
    """Which of a step's tensors an export takes, and what it left out."""

    tensors: list[GlobalTensor]
    skipped_local: list[str]  # rank-local entries of a step of several ranks
    skipped_other: list[str]  # tensors that --only left out


def prefixes(given: str | Sequence[str], what: str = "only") -> tuple[str, ...]:
    """``only`` or ``exclude`` as a tuple of name prefixes: one string is one prefix
    (not its characters, each a prefix)."""
    if isinstance(given, str):
        return (given,)
    # (A number is not iterable, bytes iterate as numbers, a mapping as its keys.)
    if not isinstance(given, Iterable) or isinstance(given, bytes | bytearray | Mapping):
        raise InvalidRequest(
            f"{what}= takes a name prefix (a str, e.g. {what}=\"model.\") or a list of "
            f"them, not {type(given).__name__} {given!r:.80}")
    out = tuple(given)
    if not all(isinstance(p, str) for p in out):
        raise InvalidRequest(f"{what}= takes name prefixes (strings), not {out!r:.80}")
    return out


def global_tensors(
    manifests: Sequence[RankManifest], only: str | Sequence[str] = (), strip: str = "",
    exclude: str | Sequence[str] = (),
) -> Selection:
    """The step's global tensors in state-dict order (first rank first), each with
    its distinct non-empty boxes; opaque blobs (``bytes`` nodes) are not tensors.
    ``only``: keep names starting with this prefix, or one of these; ``exclude``:
    then leave out those starting with this prefix, or one of these; ``strip``:
    remove this prefix from the names that have it (``InvalidRequest`` when none
    has it: a mistyped prefix)."""
    only = prefixes(only)
    exclude = prefixes(exclude, "exclude")
    blobs: set[str] = set()
    places: dict[str, list[object]] = {}
    for m in manifests:
        _blobs(m.tree, blobs)
        _places(m.tree, [], places)
    by_name: dict[str, GlobalTensor] = {}
    boxes_seen: dict[str, set[Box]] = {}
    skipped_local: list[str] = []
    skipped_other: list[str] = []
    several = len(manifests) > 1
    for m in manifests:
        for e in m.entries:
            if e.name in blobs:
                continue
            if (only and not e.name.startswith(only)) or (
                    exclude and e.name.startswith(exclude)):
                if e.name not in skipped_other:
                    skipped_other.append(e.name)
                continue
            if e.placement == "local" and several:
                # A rank's own state (an RNG, a data loader position): no global tensor.
                if e.name not in skipped_local:
                    skipped_local.append(e.name)
                continue
            t = by_name.get(e.name)
            if t is None:
                t = GlobalTensor(_stripped(e.name, strip), e.name, e.dtype,
                                 tuple(e.global_shape), path=places.get(e.name, [e.name]))
                by_name[e.name] = t
                boxes_seen[e.name] = set()
            elif e.placement == "local":
                continue  # (one rank: its only copy is taken)
            if (e.dtype, tuple(e.global_shape)) != (t.dtype, t.shape):
                raise InvalidRequest(f"{e.name!r}: ranks disagree on its dtype or shape")
            box = (tuple(e.offsets), tuple(e.shape))
            if math.prod(box[1]) and box not in boxes_seen[e.name]:
                boxes_seen[e.name].add(box)
                t.boxes.append(StoredBox(e, m.chunk_size))
    tensors = list(by_name.values())
    names: dict[str, str] = {}
    for t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedValue(
                f"{t.source!r} is {t.dtype}, which safetensors cannot hold; leave it out "
                f"with --exclude {t.source} (exclude=[{t.source!r}])", name=t.source)
        if t.dtype in PACKED_DTYPES and not t.shape:
            raise UnsupportedValue(
                f"{t.source!r} is a 0-d {t.dtype} (two fp4 values in one byte), which "
                f"safetensors cannot hold (an F4 shape counts fp4 values); leave it out with "
                f"--exclude {t.source} (exclude=[{t.source!r}])", name=t.source)
        if not t.name:
            raise InvalidRequest(f"--strip {strip!r} leaves {t.source!r} with no name")
        if t.name in names:
            raise InvalidRequest(f"--strip {strip!r} gives {names[t.name]!r} and {t.source!r} "
                                 f"the same name {t.name!r}")
        names[t.name] = t.source
        t.boxes.sort(key=lambda b: run_start(b.entry.offsets, t.shape))
    if strip and tensors and not any(t.source.startswith(strip) for t in tensors):
        # (Names exported unchanged were not what the --strip asked for: a typo.)
        some = ", ".join(repr(t.source) for t in tensors[:3])
        raise InvalidRequest(f"--strip {strip!r} matches no exported name (they are {some}"
                             f"{' ...' if len(tensors) > 3 else ''}); check it, or leave it out")
    return Selection(tensors, skipped_local, skipped_other)


def kept_metadata(manifests: Sequence[RankManifest]) -> dict[str, str]:
    """The ``__metadata__`` an import of safetensors kept (``METADATA_META``), to
    write back: its string entries, ckptd's own keys left to the export."""
    for m in manifests:
        kept = m.meta.get(METADATA_META)
        if isinstance(kept, dict):
            return {k: v for k, v in kept.items() if isinstance(k, str) and
                    isinstance(v, str) and not k.startswith("ckptd.")}
    return {}


def _stripped(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _blobs(node: dict[str, object], out: set[str]) -> None:
    ((kind, body),) = node.items()
    if kind == "bytes" and isinstance(body, str):
        out.add(body)
    elif kind == "dict" and isinstance(body, list):
        for _, child in body:
            _blobs(child, out)
    elif kind in ("list", "tuple") and isinstance(body, list):
        for child in body:
            _blobs(child, out)


def _places(node: dict[str, object], path: list[object], out: dict[str, list[object]]) -> None:
    """Entry name -> its place in the state (``PATHS_KEY``'s form), first seen first."""
    ((kind, body),) = node.items()
    if kind == "tensor" and isinstance(body, str):
        out.setdefault(body, path)
    elif kind == "dict" and isinstance(body, list):
        for key, child in body:
            _places(child, [*path, key], out)
    elif kind in ("list", "tuple") and isinstance(body, list):
        for i, child in enumerate(body):
            _places(child, [*path, [i]], out)


def nested_state(tensors: Mapping[str, object], paths: Mapping[str, object]
                 ) -> dict[object, object]:
    """The state that holds each tensor at its place: ``paths[name]`` (``PATHS_KEY``'s
    form), ``[name]`` for a name it lacks; items of a list as a list.
    ``ValueError`` saying why when the places are not a state's (a bad path, two
    tensors at one place, a tensor where another's container is, a list with gaps)."""
    root: dict[object, object] = {}
    is_list: dict[int, bool] = {id(root): False}  # the containers made, by id
    for name, value in tensors.items():
        path = paths.get(name, [name])
        if not isinstance(path, list) or not path:
            raise ValueError(f"the place of {name!r} is not a list of keys")
        node = root
        for depth, step in enumerate(path):
            if isinstance(step, list) and len(step) == 1 and _index(step[0]):
                key, listed = step[0], True
            elif isinstance(step, str) or _index(step):
                key, listed = step, False
            else:
                raise ValueError(f"the place of {name!r} holds {step!r}, which is no key")
            if (is_list[id(node)] != listed and node) or (listed and node is root):
                raise ValueError(f"the place of {name!r} mixes a list and a mapping")
            is_list[id(node)] = listed
            last = depth == len(path) - 1
            child = node.get(key)
            if last:
                if child is not None:
                    raise ValueError(f"{name!r} is placed where another tensor is")
                node[key] = value
            elif child is None:
                child = node[key] = {}
                is_list[id(child)] = False
            elif not isinstance(child, dict) or id(child) not in is_list:
                raise ValueError(f"{name!r} is placed inside another tensor")
            if not last:
                assert isinstance(child, dict)
                node = child

    def build(node: dict[object, object]) -> object:
        out = {k: build(v) if isinstance(v, dict) and id(v) in is_list else v
               for k, v in node.items()}
        if not is_list[id(node)]:
            return out
        if set(out) != set(range(len(out))):  # (its keys are ints: _index)
            raise ValueError("a list's items are not all there")
        return [out[i] for i in range(len(out))]

    state = build(root)
    assert isinstance(state, dict)
    return state


def _index(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True, slots=True)
class Placed:
    """A tensor in a file: bytes ``[begin, end)`` of the file's data section."""

    tensor: GlobalTensor
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One safetensors file: its name, its tensors in data order, its header."""

    filename: str
    placed: list[Placed]
    header: bytes  # the 8-byte length and the padded JSON: the data starts after it

    @property
    def data_bytes(self) -> int:
        return self.placed[-1].end if self.placed else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


def plan_files(tensors: Sequence[GlobalTensor], max_shard_size: int,
               metadata: dict[str, str]) -> list[FilePlan]:
    """Hugging Face's split: tensors in order, a new file when the next would pass
    ``max_shard_size``, a tensor larger than it alone in its file. One file is
    ``model.safetensors``, several ``model-00001-of-0000N.safetensors``."""
    groups: list[list[GlobalTensor]] = []
    current: list[GlobalTensor] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_shard_size:
            groups.append([t])
            continue
        if current and size + t.nbytes > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    n = len(groups)
    plans = []
    for i, group in enumerate(groups):
        name = SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        plans.append(layout_file(name, group, metadata))
    return plans


def layout_file(filename: str, tensors: Sequence[GlobalTensor], metadata: dict[str, str]
                ) -> FilePlan:
    """Where each tensor goes in one file, and the file's header."""
    if any(t.path not in (None, [t.name]) for t in tensors):  # (state-dict order)
        places = {t.name: t.path or [t.name] for t in tensors}
        metadata = {**metadata, PATHS_KEY: json.dumps(places, separators=(",", ":"),
                                                      ensure_ascii=False)}
    ordered = sorted(tensors, key=lambda t: (-_RANK[t.dtype], t.name))
    placed: list[Placed] = []
    at = 0
    for t in ordered:
        placed.append(Placed(t, at, at + t.nbytes))
        at += t.nbytes
    return FilePlan(filename, placed, header_bytes(placed, metadata))


def header_bytes(placed: Sequence[Placed], metadata: dict[str, str]) -> bytes:
    """The header of a file holding ``placed``: its length (u64, little-endian)
    and the JSON, padded with spaces to a multiple of 8 bytes."""
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(sorted(metadata.items()))
    for p in placed:
        doc[p.tensor.name] = {"dtype": SAFETENSORS_DTYPES[p.tensor.dtype],
                              "shape": header_shape(p.tensor.dtype, p.tensor.shape),
                              "data_offsets": [p.begin, p.end]}
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise InvalidRequest(f"a file's header would be {len(text)} bytes, past safetensors' "
                             f"{MAX_HEADER}: lower --max-shard-size")
    return struct.pack("<Q", len(text)) + text


def header_shape(dtype: str, shape: Sequence[int]) -> list[int]:
    """A tensor's shape in a safetensors header: its last dimension in values, not
    bytes, for a packed dtype (``float4_e2m1fn_x2`` [4, 8] is ``F4`` [4, 16])."""
    per = PACKED_DTYPES.get(dtype, 1)
    return [*shape[:-1], shape[-1] * per] if shape else []


def index_bytes(plans: Sequence[FilePlan]) -> bytes:
    """``model.safetensors.index.json``: the total size and each tensor's file."""
    weight_map = {p.tensor.name: plan.filename for plan in plans for p in plan.placed}
    total = sum(plan.data_bytes for plan in plans)
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
