"""The staging pool's on-disk format: its control file and its ``index.json``.

A pool outlives the process that wrote it (a crashed worker's staged snapshot is
what its restart restores from), so what it writes is a format, read by another
process and possibly another version of ckptd: specified in docs/FORMAT.md
("Staging pool"), parsed strictly here into frozen values, and refused with
``UnsupportedFormat`` when it is of a version this code does not know. The
golden pool ``tests/data/golden-pool-v1`` and ``tests/unit/test_staging_format.py``
keep it from changing by accident.

Both documents are hints, never trusted: a reader hash-checks every chunk.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Literal

from ckptd.errors import InvalidDocument, UnsupportedFormat

POOL_VERSION = 1
INDEX_NAME = "index.json"
INDEX_FORMAT = "ckptd.staging_index"
CONTROL_NAME = "control"
CONTROL_SIZE = 64
CONTROL_PREFIX = b"CKPTDSP"  # then one ASCII digit: the version
CONTROL_MAGIC = CONTROL_PREFIX + str(POOL_VERSION).encode()
GEN_AT = 8  # u64 little-endian: the seqlock generation
PID_AT = 16  # u64 little-endian: the owner's pid (0: unknown)

PoolState = Literal["staging", "staged"]
_STATES = ("staging", "staged")


def _int(doc: dict[str, Any], key: str, where: str, *, nonneg: bool = True) -> int:
    value = doc.get(key)
    if type(value) is not int or (nonneg and value < 0):
        raise InvalidDocument(f"{where}: {key!r} must be a non-negative integer, got {value!r}",
                              document=where, field=key)
    return value


def _str(doc: dict[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise InvalidDocument(f"{where}: {key!r} must be a string, got {value!r}",
                              document=where, field=key)
    return value


def _ints(doc: dict[str, Any], key: str, where: str) -> tuple[int, ...]:
    value = doc.get(key)
    if not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value):
        raise InvalidDocument(f"{where}: {key!r} must be a list of non-negative integers",
                              document=where, field=key)
    return tuple(value)


def _unsupported(where: str, version: int) -> UnsupportedFormat:
    return UnsupportedFormat(
        f"{where} is a staging pool of version {version}; this ckptd reads version "
        f"{POOL_VERSION}. Remove the pool (ckptd's remove_stale_pools) or use the "
        "ckptd that wrote it.",
        document=where, version=version, supported=[POOL_VERSION],
    )


def _fields(doc: Any, required: set[str], optional: set[str], where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise InvalidDocument(f"{where} is not a JSON object", document=where)
    missing = required - doc.keys()
    unknown = doc.keys() - required - optional
    if missing or unknown:
        raise InvalidDocument(
            f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}",
            document=where, missing=sorted(missing), unknown=sorted(unknown),
        )
    return doc


@dataclass(frozen=True, slots=True)
class ControlHeader:
    """The first bytes of a pool's ``control`` file (the rest of its 64 bytes are 0).

    The owner holds an exclusive ``flock`` on the file for its life and bumps
    ``generation`` (the seqlock) in place; ``pid`` names the owner."""

    generation: int
    pid: int
    version: int = POOL_VERSION

    def pack(self) -> bytes:
        out = bytearray(CONTROL_SIZE)
        out[:8] = CONTROL_PREFIX + str(self.version).encode()
        struct.pack_into("<Q", out, GEN_AT, self.generation)
        struct.pack_into("<Q", out, PID_AT, self.pid)
        return bytes(out)

    @classmethod
    def unpack(cls, data: bytes, where: str = CONTROL_NAME) -> ControlHeader:
        """Parses a control file's bytes: ``UnsupportedFormat`` for another version,
        ``InvalidDocument`` for anything that is not a control file."""
        if len(data) < CONTROL_SIZE or data[:7] != CONTROL_PREFIX or not data[7:8].isdigit():
            raise InvalidDocument(f"{where} is not a staging pool control file",
                                  document=where)
        version = int(data[7:8])
        if version != POOL_VERSION:
            raise _unsupported(where, version)
        generation, = struct.unpack_from("<Q", data, GEN_AT)
        pid, = struct.unpack_from("<Q", data, PID_AT)
        return cls(generation=int(generation), pid=int(pid), version=version)


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    """One segment of the pool: its file name in the pool directory, its size, and
    whether it is a file there (False: a private memfd that died with its owner)."""

    file: str
    nbytes: int
    shared: bool

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "nbytes": self.nbytes, "shared": self.shared}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> SegmentRecord:
        doc = _fields(doc, {"file", "nbytes", "shared"}, set(), where)
        if not isinstance(doc["shared"], bool):
            raise InvalidDocument(f"{where}: 'shared' must be a boolean", document=where)
        return cls(_segment_name(doc, where), _int(doc, "nbytes", where), doc["shared"])


def _segment_name(doc: dict[str, Any], where: str) -> str:
    name = _str(doc, "file" if "file" in doc else "segment", where)
    # A name, never a path: a reader opens it inside the pool directory only.
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise InvalidDocument(f"{where}: bad segment name {name!r}", document=where)
    return name


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """Bytes ``[start, end)`` of one tensor's C-order bytes, staged in ``segment`` at
    ``offset``. ``start`` is a multiple of the chunk size, so the span's chunks are
    the tensor's chunks ``first_chunk`` onwards; ``chunks`` (their ids) once the
    pipeline hashed them, else None."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # of the whole tensor
    start: int
    end: int
    first_chunk: int
    segment: str
    offset: int
    chunks: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "nbytes": self.nbytes, "start": self.start, "end": self.end,
            "first_chunk": self.first_chunk, "segment": self.segment, "offset": self.offset,
        }
        if self.chunks is not None:
            doc["chunks"] = list(self.chunks)
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str) -> SpanRecord:
        keys = {"name", "dtype", "shape", "nbytes", "start", "end", "first_chunk", "segment",
                "offset"}
        doc = _fields(doc, keys, {"chunks"}, where)
        start, end = _int(doc, "start", where), _int(doc, "end", where)
        nbytes = _int(doc, "nbytes", where)
        if not start <= end <= nbytes:
            raise InvalidDocument(f"{where}: span [{start}, {end}) outside {nbytes} bytes",
                                  document=where)
        chunks = doc.get("chunks")
        if chunks is not None and (
            not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks)
        ):
            raise InvalidDocument(f"{where}: 'chunks' must be a list of chunk ids",
                                  document=where)
        return cls(
            name=_str(doc, "name", where), dtype=_str(doc, "dtype", where),
            shape=_ints(doc, "shape", where), nbytes=nbytes, start=start, end=end,
            first_chunk=_int(doc, "first_chunk", where), segment=_segment_name(doc, where),
            offset=_int(doc, "offset", where),
            chunks=None if chunks is None else tuple(chunks),
        )


@dataclass(frozen=True, slots=True)
class PoolIndex:
    """A pool's ``index.json``: what its segments hold (see docs/FORMAT.md)."""

    job: str
    rank: int
    pid: int
    state: PoolState
    step: int | None
    generation: int  # the seqlock generation the bytes have once the copies are done
    chunk_size: int
    piece: tuple[int, int]  # (this piece, pieces of the save)
    segments: tuple[SegmentRecord, ...]
    entries: tuple[SpanRecord, ...]
    version: int = POOL_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT, "version": self.version, "job": self.job,
            "rank": self.rank, "pid": self.pid, "state": self.state, "step": self.step,
            "generation": self.generation, "chunk_size": self.chunk_size,
            "piece": list(self.piece), "segments": [s.to_json() for s in self.segments],
            "entries": [e.to_json() for e in self.entries],
        }

    def encode(self) -> bytes:
        """The bytes written to ``index.json`` (compact JSON, keys in this order)."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes | str, where: str = INDEX_NAME) -> PoolIndex:
        """Parses ``index.json``: ``UnsupportedFormat`` for another version,
        ``InvalidDocument`` for anything else that is not this format."""
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise InvalidDocument(f"{where} is not JSON: {exc}", document=where) from None
        if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
            raise InvalidDocument(f"{where} is not a staging pool index", document=where)
        version = doc.get("version")
        if type(version) is not int:
            raise InvalidDocument(f"{where}: 'version' must be an integer", document=where)
        if version != POOL_VERSION:
            raise _unsupported(where, version)
        keys = {"format", "version", "job", "rank", "pid", "state", "step", "generation",
                "chunk_size", "piece", "segments", "entries"}
        _fields(doc, keys, set(), where)
        state = doc["state"]
        if state not in _STATES:
            raise InvalidDocument(f"{where}: unknown state {state!r}", document=where)
        step = doc["step"]
        if step is not None and (type(step) is not int or step < 0):
            raise InvalidDocument(f"{where}: bad step {step!r}", document=where)
        piece = _ints(doc, "piece", where)
        if len(piece) != 2 or piece[0] >= piece[1]:
            raise InvalidDocument(f"{where}: bad piece {list(piece)}", document=where)
        segments, entries = doc["segments"], doc["entries"]
        if not isinstance(segments, list) or not isinstance(entries, list):
            raise InvalidDocument(f"{where}: segments and entries must be lists",
                                  document=where)
        return cls(
            job=_str(doc, "job", where), rank=_int(doc, "rank", where),
            pid=_int(doc, "pid", where), state=state, step=step,
            generation=_int(doc, "generation", where),
            chunk_size=_int(doc, "chunk_size", where), piece=(piece[0], piece[1]),
            segments=tuple(SegmentRecord.from_json(s, f"{where} segments[{i}]")
                           for i, s in enumerate(segments)),
            entries=tuple(SpanRecord.from_json(e, f"{where} entries[{i}]")
                          for i, e in enumerate(entries)),
            version=version,
        )


__all__ = [
    "CONTROL_MAGIC",
    "CONTROL_NAME",
    "CONTROL_SIZE",
    "GEN_AT",
    "INDEX_FORMAT",
    "INDEX_NAME",
    "PID_AT",
    "POOL_VERSION",
    "ControlHeader",
    "PoolIndex",
    "PoolState",
    "SegmentRecord",
    "SpanRecord",
]
