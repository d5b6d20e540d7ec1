"""The on-store format, version 1: canonical JSON and the documents (names and
keys are in ``ckptd.keys``, re-exported here).

``docs/FORMAT.md`` is the prose of this module; keep them in agreement. Documents
are JSON in a canonical encoding (sorted keys, no spaces, UTF-8, no NaN), so the
same content always gives the same bytes and the same blake3.

A module a little past the house's ~500 lines on purpose: it is FORMAT.md's code
(canonical JSON and every document of the version), read beside that page.
"""

from __future__ import annotations

import json
import math
import re
import weakref
from typing import Any, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ckptd import dtypes, large_json
from ckptd import keys as _keys
from ckptd.errors import InvalidDocument, UnsupportedFormat
from ckptd.hashing import chunk_count, document_hash
from ckptd.knobs import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

# Names and keys live in ``ckptd.keys``; every module that reads the format finds
# them here too.
CHUNK_ID_RE = _keys.CHUNK_ID_RE
JOB_RE = _keys.JOB_RE
MAX_STEP = _keys.MAX_STEP
MAX_WORLD_SIZE = _keys.MAX_WORLD_SIZE
RANK_PATTERN = _keys.RANK_PATTERN
STEP_PATTERN = _keys.STEP_PATTERN
check_chunk_id = _keys.check_chunk_id
check_job = _keys.check_job
check_rank = _keys.check_rank
check_step = _keys.check_step
check_world_size = _keys.check_world_size
chunk_key = _keys.chunk_key
commit_key = _keys.commit_key
job_prefix = _keys.job_prefix
latest_key = _keys.latest_key
manifest_key = _keys.manifest_key
removal_key = _keys.removal_key
step_prefix = _keys.step_prefix
timeline_key = _keys.timeline_key

FORMAT_VERSION: Final = 1
MANIFEST_FORMAT: Final = "ckptd.rank_manifest"
COMMIT_FORMAT: Final = "ckptd.commit"
REF_FORMAT: Final = "ckptd.ref"
TIMELINE_FORMAT: Final = "ckptd.timeline"
EPOCH_META: Final = "epoch"  # the rank manifest's meta key naming its timeline
INCARNATION_META: Final = "incarnation"  # (1.2) its meta key naming the launch that wrote it

MAX_NAME_LEN = 4096
# (1.3) Entries of one name one manifest may hold: a rank's local shards of one
# tensor. Bounded so that checking them for overlap stays cheap (pairwise).
MAX_LOCAL_SHARDS = 64
MAX_TREE_DEPTH = 64
# A tensor restores into memory: every dimension, offset and element count fits
# int64 (torch's sizes), and no tensor has more dimensions than this.
MAX_DIMS = 64
MAX_INT64 = 2**63 - 1
# JSON nesting of any document or request body: a tree MAX_TREE_DEPTH deep nests
# about three levels per node, plus the document's own.
MAX_JSON_DEPTH = 3 * MAX_TREE_DEPTH + 32

Placement = Literal["replicated", "sharded", "local"]


# -- canonical JSON ---------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """The one encoding of a document: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _refuse_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity; canonical JSON has no such tokens.
    raise ValueError(f"{name} is not JSON")


def json_too_deep(data: bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``data`` nests deeper than ``limit`` (see ckptd.large_json)."""
    return large_json.json_too_deep(data, limit)


# Larger documents are decoded piece by piece (see ckptd.large_json).
PIECEWISE_JSON_BYTES = 1 << 20


def _parse_json(data: bytes, what: str) -> Any:
    if json_too_deep(data):
        raise InvalidDocument(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        if len(data) > PIECEWISE_JSON_BYTES:
            return large_json.decode_piecewise(data.decode("utf-8"))
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidDocument(f"{what} is not valid JSON: {exc}") from None


def _check_header(doc: Any, fmt: str, what: str) -> None:
    if not isinstance(doc, dict):
        raise InvalidDocument(f"{what} must be a JSON object")
    if doc.get("format") != fmt:
        raise InvalidDocument(f"{what} has format {doc.get('format')!r}, expected {fmt!r}")
    version = doc.get("version")
    if type(version) is not int or version != FORMAT_VERSION:  # true and 1.0 are not 1
        raise UnsupportedFormat(
            f"{what} has format version {version!r}; this ckptd reads version {FORMAT_VERSION}",
            version=version,
        )


def _pydantic_error(exc: ValidationError, what: str) -> InvalidDocument:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return InvalidDocument(f"{what}: {where}: {first.get('msg')}", errors=exc.error_count())


_D = TypeVar("_D", bound="_Document")


def _load(cls: type[_D], data: bytes, fmt: str, what: str) -> _D:
    """Parses a document's bytes: JSON, its header, then its fields."""
    doc = _parse_json(data, what)
    _check_header(doc, fmt, what)
    try:
        return cls.model_validate(doc)
    except ValidationError as exc:
        raise _pydantic_error(exc, what) from None


# Canonical bytes and digests of documents, by id(): documents are frozen, and a
# 100,000-tensor manifest's encoding costs seconds, asked for at put, commit and
# plan time. (Not private attributes: pydantic would compare them in ==.)
_ENCODED: dict[int, tuple[bytes, str | None]] = {}
_CHECKED: set[int] = set()


def _forget(key: int) -> None:
    _ENCODED.pop(key, None)
    _CHECKED.discard(key)


class _Document(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, defer_build=True)

    def canonical(self) -> bytes:
        held = _ENCODED.get(id(self))
        if held is not None:
            return held[0]
        data = canonical_json(self.model_dump(mode="json"))
        self._remember(data, None)
        return data

    def digest(self) -> str:
        held = _ENCODED.get(id(self))
        if held is not None and held[1] is not None:
            return held[1]
        data = self.canonical()
        digest = document_hash(data)
        self._remember(data, digest)
        return digest

    def _remember(self, data: bytes, digest: str | None) -> None:
        if id(self) not in _ENCODED:
            weakref.finalize(self, _forget, id(self))
        _ENCODED[id(self)] = (data, digest)


# -- the rank manifest ------------------------------------------------------------------


class TensorEntry(_Document):
    """One tensor (or one shard of a global tensor) held by a rank."""

    name: str = Field(min_length=1, max_length=MAX_NAME_LEN)
    dtype: str
    placement: Placement
    global_shape: list[int]
    offsets: list[int]
    shape: list[int]
    nbytes: int = Field(ge=0, le=MAX_INT64)
    chunks: list[str]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class RankManifest(_Document):
    """What one rank holds at one step: its tensors, chunked, and its other leaves."""

    format: Literal["ckptd.rank_manifest"] = MANIFEST_FORMAT
    version: Literal[1] = FORMAT_VERSION
    job: str
    step: int
    rank: int
    world_size: int
    chunk_size: int
    entries: list[TensorEntry]
    tree: Any
    meta: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def parse(cls, data: bytes, committed: str | None = None) -> RankManifest:
        """Parses and checks a manifest. The entries are validated in slices, so a
        thread parsing 100,000 of them gives the GIL back between slices (one
        validation call over all of them held it for the whole of it).

        ``committed``: the digest a commit record names, which ``data`` was checked
        against (``document_hash(data) == committed``): those bytes are then the
        canonical encoding that digest was taken of, kept as such rather than
        encoded again (two thirds of the parse of a 342-tensor manifest). Not when
        they hold a ``\\u`` escape: the encoding is what refuses a lone surrogate
        in the tree, and canonical bytes escape only control characters."""
        doc = _parse_json(data, "rank manifest")
        _check_header(doc, MANIFEST_FORMAT, "rank manifest")
        entries = doc.get("entries")
        if not isinstance(entries, list) or len(entries) <= PARSE_SLICE:
            try:  # (the JSON is decoded once: _load would decode it again)
                manifest = cls.model_validate(doc)
            except ValidationError as exc:
                raise _pydantic_error(exc, "rank manifest") from None
        else:
            try:
                head = cls.model_validate({**doc, "entries": []})
                validated: list[TensorEntry] = []
                for start in range(0, len(entries), PARSE_SLICE):
                    validated.extend(_ENTRIES.validate_python(
                        entries[start:start + PARSE_SLICE], strict=True))
                    large_json.scan_so_far()
            except ValidationError as exc:
                raise _pydantic_error(exc, "rank manifest") from None
            manifest = head.model_copy(update={"entries": validated})
        if committed is not None and b"\\u" not in data:
            manifest._remember(data, committed)
        # (Which also encodes it once, for canonical() and digest(), unless the
        # committed bytes are kept as its encoding just above.)
        manifest.check()
        return manifest

    def canonical(self) -> bytes:
        """The canonical bytes, encoded slice by slice for a large manifest (one
        encoding call over 100,000 entries held the GIL for its whole length)."""
        held = _ENCODED.get(id(self))
        if held is not None:
            return held[0]
        if len(self.entries) <= PARSE_SLICE:
            return super().canonical()
        head = self.model_dump(mode="json", exclude={"entries", "tree"})
        head["entries"] = head["tree"] = _SPLICE
        text = canonical_json(head)
        # Sorted keys: "entries" is the first occurrence of the marker (only
        # chunk_size precedes it), "tree" the last (only version and world_size follow).
        before, after = text.split(_SPLICE_JSON, 1)
        middle, end = after.rsplit(_SPLICE_JSON, 1)
        data = b"".join([
            before,
            large_json.encode_sliced(self.entries, lambda s: _ENTRIES.dump_python(s, mode="json")),
            middle, large_json.encode_tree(self.tree), end,
        ])
        self._remember(data, None)
        return data

    def check(self) -> None:
        """Checks what one manifest can say about itself (not across ranks); once
        per (immutable) manifest."""
        if id(self) in _CHECKED:
            return
        self._check()
        if id(self) not in _ENCODED:
            weakref.finalize(self, _forget, id(self))
        _CHECKED.add(id(self))

    def _check(self) -> None:
        check_job(self.job)
        check_step(self.step)
        # A world size is a field of the document, not a name in a URL: a bad one is
        # a malformed document (as ``chunk_size`` is), not ``invalid_name``.
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:  # (strict: an int, not a bool)
            raise InvalidDocument(
                f"rank manifest: world_size {self.world_size!r} must be in "
                f"[1, {MAX_WORLD_SIZE}]", field="world_size")
        check_rank(self.rank, self.world_size, job=self.job)
        manifest_epoch(self)
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidDocument(
                f"chunk_size {self.chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
            )
        names: set[str] = set()
        repeated: dict[str, list[TensorEntry]] = {}
        # Entries of one geometry pass or fail alike (a model repeats its layers):
        # the first of each is checked, in order, so the first bad entry is named.
        geometries: set[tuple[Any, ...]] = set()
        for entry in self.entries:
            geometry = (entry.dtype, entry.placement, tuple(entry.global_shape),
                        tuple(entry.offsets), tuple(entry.shape), entry.nbytes,
                        len(entry.chunks))
            if geometry not in geometries:
                self._check_entry(entry)
                geometries.add(geometry)
            if entry.name in names:
                repeated.setdefault(entry.name, [])
            names.add(entry.name)
        if repeated:
            for entry in self.entries:
                if entry.name in repeated:
                    repeated[entry.name].append(entry)
            for name, shards in repeated.items():
                _check_local_shards(name, shards)
        ids = [cid for entry in self.entries for cid in entry.chunks]
        # (one match over all the ids; on a mismatch, the entry is found and named)
        if not (all(len(cid) == 64 for cid in ids) and _HEX.fullmatch("".join(ids))):
            for entry in self.entries:
                _check_chunk_ids(entry)
        referenced: set[str] = set()
        blobs: set[str] = set()
        check_tree(self.tree, referenced, blobs=blobs)
        for entry in self.entries:
            if entry.name in blobs and (entry.dtype != "uint8" or len(entry.shape) != 1):
                raise InvalidDocument(
                    f"entry {entry.name!r} of a bytes node must be 1-D uint8", name=entry.name
                )
        if referenced != names:
            extra = sorted(names - referenced)[:5] or sorted(referenced - names)[:5]
            raise InvalidDocument(
                "the tree and the entries do not name the same tensors", names=extra
            )
        try:  # NaN in meta, a lone surrogate in a name: no canonical bytes to store
            canonical_json(self.meta)  # (model_dump would quietly turn NaN into null)
            self.canonical()
        except ValueError as exc:
            raise InvalidDocument(f"manifest has no canonical JSON encoding: {exc}") from None

    def _check_entry(self, e: TensorEntry) -> None:
        where = f"entry {e.name!r}"
        size = dtypes.itemsize(e.dtype)
        if not (len(e.global_shape) == len(e.offsets) == len(e.shape)):
            raise InvalidDocument(f"{where}: global_shape, offsets and shape differ in rank")
        if len(e.shape) > MAX_DIMS:
            raise InvalidDocument(f"{where}: {len(e.shape)} dimensions; at most {MAX_DIMS}")
        if any(d < 0 for d in e.global_shape + e.offsets + e.shape):
            raise InvalidDocument(f"{where}: negative dimension or offset")
        if any(d > MAX_INT64 for d in e.global_shape + e.offsets + e.shape) or (
            _product_over(e.global_shape, MAX_INT64)
        ):
            raise InvalidDocument(f"{where}: shape, offset or element count beyond int64")
        if any(o + s > g for o, s, g in zip(e.offsets, e.shape, e.global_shape, strict=True)):
            raise InvalidDocument(f"{where}: shard reaches outside the global shape")
        if e.placement != "sharded" and (
            e.shape != e.global_shape or any(o != 0 for o in e.offsets)
        ):
            raise InvalidDocument(f"{where}: a {e.placement} entry must hold the whole tensor")
        if e.nbytes != e.numel * size:
            raise InvalidDocument(f"{where}: nbytes {e.nbytes} != {e.numel} x {size}")
        if len(e.chunks) != chunk_count(e.nbytes, self.chunk_size):
            raise InvalidDocument(f"{where}: {len(e.chunks)} chunks for {e.nbytes} bytes")

    def chunk_ids(self) -> set[str]:
        return {cid for e in self.entries for cid in e.chunks}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


_HEX = re.compile(r"[0-9a-f]*")


def _check_local_shards(name: str, shards: list[TensorEntry]) -> None:
    """(1.3) Several entries of one name in one manifest: shards of one global
    tensor that one rank holds (a ``ShardedTensor`` with several local shards).
    They MUST be ``sharded``, agree on dtype and global shape, and hold distinct
    boxes that do not overlap."""
    first = shards[0]
    if len(shards) > MAX_LOCAL_SHARDS:
        raise InvalidDocument(f"entry {name!r} appears {len(shards)} times; one manifest "
                              f"holds at most {MAX_LOCAL_SHARDS} shards of one tensor", name=name)
    boxes: list[tuple[list[int], list[int]]] = []
    for e in shards:
        if e.placement != "sharded":
            raise InvalidDocument(f"entry {name!r} appears twice and is {e.placement}: only "
                                  "sharded entries of one name may repeat", name=name)
        if (e.dtype, e.global_shape) != (first.dtype, first.global_shape):
            raise InvalidDocument(f"entries {name!r} of one manifest differ in dtype or "
                                  "global shape", name=name)
        for offsets, shape in boxes:
            if offsets == e.offsets and shape == e.shape:
                raise InvalidDocument(f"entry {name!r} holds box {e.offsets}+{e.shape} "
                                      "twice", name=name)
            if math.prod(shape) and e.numel and all(
                o < eo + es and eo < o + s
                for o, s, eo, es in zip(offsets, shape, e.offsets, e.shape, strict=True)
            ):
                raise InvalidDocument(f"entries {name!r} of one manifest overlap: "
                                      f"{offsets}+{shape} and {e.offsets}+{e.shape}", name=name)
        boxes.append((e.offsets, e.shape))


def _check_chunk_ids(e: TensorEntry) -> None:
    for cid in e.chunks:
        if not CHUNK_ID_RE.fullmatch(cid):
            raise InvalidDocument(f"entry {e.name!r}: bad chunk id {cid[:80]!r}")


def _product_over(dims: list[int], bound: int) -> bool:
    """Whether the product of ``dims`` (each <= bound) exceeds ``bound``; a zero
    dimension does not excuse another beyond int64 (checked by the caller)."""
    product = 1
    for d in dims:
        product *= d
        if product > bound:
            return True
    return False


# Entries validated (and encoded) per call when parsing a large manifest.
PARSE_SLICE = large_json.SLICE
_ENTRIES = TypeAdapter(list[TensorEntry], config=ConfigDict(defer_build=True))
_SPLICE = "\u0000ckptd-splice\u0000"
_SPLICE_JSON = canonical_json(_SPLICE)


# The tree is the state dict's shape with its tensors replaced by their names:
#   {"dict": [[key, node], ...]}  keys are strings or integers, in order
#   {"list": [node, ...]}   {"tuple": [node, ...]}
#   {"tensor": name}        {"value": json scalar}   {"float": "nan" | "inf" | "-inf"}
#   {"bytes": name}         an opaque blob: the 1-D uint8 entry ``name`` holds its bytes
_TREE_KINDS = {"dict", "list", "tuple", "tensor", "value", "float", "bytes"}


def check_tree(
    node: Any, tensors: set[str], depth: int = 0, blobs: set[str] | None = None
) -> None:
    """Checks a tree node and collects the entry names it references (those of
    ``bytes`` nodes also in ``blobs``)."""
    if depth > MAX_TREE_DEPTH:
        raise InvalidDocument(f"tree nested deeper than {MAX_TREE_DEPTH}")
    if not isinstance(node, dict) or len(node) != 1:
        raise InvalidDocument("tree node must be an object with one key")
    ((kind, body),) = node.items()
    if kind not in _TREE_KINDS:
        raise InvalidDocument(f"unknown tree node {kind!r}")
    if kind == "dict":
        if not isinstance(body, list):
            raise InvalidDocument("dict node must hold a list of [key, node] pairs")
        seen: set[Any] = set()
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise InvalidDocument("dict node items must be [key, node] pairs")
            key = pair[0]
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise InvalidDocument(f"dict key {key!r} must be a string or an integer")
            if (type(key), key) in seen:
                raise InvalidDocument(f"dict key {key!r} appears twice")
            seen.add((type(key), key))
            if depth >= MAX_TREE_DEPTH or not _tensor_leaf(pair[1], tensors):
                check_tree(pair[1], tensors, depth + 1, blobs)
    elif kind in ("list", "tuple"):
        if not isinstance(body, list):
            raise InvalidDocument(f"{kind} node must hold a list")
        for child in body:
            if depth >= MAX_TREE_DEPTH or not _tensor_leaf(child, tensors):
                check_tree(child, tensors, depth + 1, blobs)
    elif kind in ("tensor", "bytes"):
        if not isinstance(body, str):
            raise InvalidDocument(f"{kind} node must hold the entry name")
        if body in tensors:
            raise InvalidDocument(f"tensor {body!r} appears twice in the tree")
        tensors.add(body)
        if kind == "bytes" and blobs is not None:
            blobs.add(body)
    elif kind == "float":
        if body not in ("nan", "inf", "-inf"):
            raise InvalidDocument("float node holds only 'nan', 'inf' or '-inf'")
    else:  # value
        if not (body is None or isinstance(body, bool | int | float | str)):
            raise InvalidDocument("value node holds only a JSON scalar")
        if isinstance(body, float) and not math.isfinite(body):
            raise InvalidDocument("a NaN or infinite float goes in a float node, not a value node")


def _tensor_leaf(node: Any, tensors: set[str]) -> bool:
    """check_tree of a well-formed ``{"tensor": name}`` node, without the call
    (100,000 of them in a large manifest's tree); False for any other node."""
    if type(node) is not dict or len(node) != 1:
        return False
    name = node.get("tensor")
    if type(name) is not str or name in tensors:  # (check_tree says what is wrong)
        return False
    tensors.add(name)
    return True


# -- the commit record -----------------------------------------------------------------


class ManifestRef(_Document):
    rank: int
    hash: str
    size: int


class ValidationReport(_Document):
    """What the cross-rank validation found when a step committed."""

    tensors: int
    logical_bytes: int
    chunks: int
    replicated_entries: int
    sharded_entries: int
    local_entries: int
    warnings: list[str] = Field(default_factory=list)


class CommitRecord(_Document):
    """Names every rank manifest of a committed step. Its existence is the commit."""

    format: Literal["ckptd.commit"] = COMMIT_FORMAT
    version: Literal[1] = FORMAT_VERSION
    job: str
    step: int
    world_size: int
    manifests: list[ManifestRef]
    report: ValidationReport
    committed_at: float
    meta: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def parse(cls, data: bytes) -> CommitRecord:
        record = _load(cls, data, COMMIT_FORMAT, "commit record")
        check_job(record.job)
        check_step(record.step)
        if not 1 <= record.world_size <= MAX_WORLD_SIZE:  # (a step of no ranks is no step)
            raise InvalidDocument(
                f"commit record: world_size {record.world_size!r} must be in "
                f"[1, {MAX_WORLD_SIZE}]", field="world_size")
        if [m.rank for m in record.manifests] != list(range(record.world_size)):
            raise InvalidDocument("commit record must name one manifest per rank, in order")
        return record


class Ref(_Document):
    """A mutable pointer (``latest``): the only kind of object that changes."""

    format: Literal["ckptd.ref"] = REF_FORMAT
    version: Literal[1] = FORMAT_VERSION
    step: int
    commit: str

    @classmethod
    def parse(cls, data: bytes) -> Ref:
        return _load(cls, data, REF_FORMAT, "ref")


class Timeline(_Document):
    """How many rollbacks a job has had (``epoch``) and the last one's target.

    Every rollback starts a new timeline; a rank manifest names the timeline it
    was saved in (``meta["epoch"]``, 0 when absent), and only manifests of the
    job's current timeline are accepted or committed. Unlike the rollback
    marker it is never deleted: clearing a rollback keeps the count."""

    format: Literal["ckptd.timeline"] = TIMELINE_FORMAT
    version: Literal[1] = FORMAT_VERSION
    epoch: int = Field(ge=1)
    step: int
    commit: str

    @classmethod
    def parse(cls, data: bytes) -> Timeline:
        return _load(cls, data, TIMELINE_FORMAT, "timeline")


def manifest_epoch(manifest: RankManifest) -> int:
    """The timeline a rank manifest was saved in (0: before any rollback)."""
    epoch = manifest.meta.get(EPOCH_META, 0)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise InvalidDocument(
            f"rank manifest meta {EPOCH_META!r} must be a non-negative integer, not {epoch!r}"
        )
    return epoch


def manifest_incarnation(manifest: RankManifest) -> object:
    """The launch of the job that wrote a rank manifest (1.2; None: not known).

    Compared for equality only: an older producer's free-form meta may hold any
    JSON value under the key, and such a manifest must still read."""
    return manifest.meta.get(INCARNATION_META)
