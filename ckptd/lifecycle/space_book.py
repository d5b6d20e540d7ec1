"""The census's book: each counted step's distinct chunks as two compact arrays,
and the bytes per job and per step they add up to (docs/design/020-census.md).

This module is what the census worker process runs (``ckptd.lifecycle.census``
drives it): it parses commit records and rank manifests itself, a manifest one
entry at a time, keeping only each chunk's id prefix and size, never building
the manifest's objects; and it keeps 12 bytes per distinct chunk of each step.
Chunk ids are compared by their first 64 bits: two distinct chunks that share
them (about one chance in 40 million among a million chunks) count as one.

A step's count may be kept in the store as a space summary
(``space/<job>/<step>.json``, docs/FORMAT.md "Space summaries"): a hint that
saves reading the step's manifests again, never used to decide what to delete.
"""

from __future__ import annotations

import base64
import json
import re
from array import array
from dataclasses import dataclass, field
from typing import Any, Final

import blake3
import numpy as np

from ckptd.lifecycle.book_views import Begun, BookError, BookView, JobView

# (Nothing here imports pydantic or ckptd.format: the worker starts in a fifth of
# the time, and parses its documents itself.)

SPACE_FORMAT: Final = "ckptd.step_space"

_IDS = np.dtype(">u8")  # a chunk id's first 8 bytes, as stored in a summary
_SIZES = np.dtype("<u4")  # chunk sizes: at most 256 MiB
_HEX = frozenset("0123456789abcdef")

_RECORD_FIELDS = frozenset({"format", "version", "job", "step", "world_size", "manifests",
                            "report", "committed_at", "meta"})
_SUMMARY_FIELDS = frozenset({"format", "version", "job", "step", "commit", "logical_bytes",
                             "chunks", "chunk_bytes", "ids", "sizes"})


def canonical(doc: dict[str, Any]) -> bytes:
    """The format's canonical JSON (docs/FORMAT.md, ``ckptd.format.canonical_json``)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


class _Newer(ValueError):
    """A document of a version this ckptd does not know: a newer ckptd's."""


# A canonical rank manifest's end: its version, then its world size.
_MANIFEST_TAIL = re.compile(r',"version":(-?\d+|[^,]*),"world_size":\d+}$')


def _is_int(value: object, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _document(data: bytes, fmt: str, fields: frozenset[str]) -> dict[str, Any]:
    """A document's JSON object, checked as every reader checks one: its format,
    a version it knows (``_Newer`` otherwise), exactly its fields."""
    doc = json.loads(data.decode("utf-8", errors="strict"))
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ValueError(f"not a {fmt} document")
    if doc.get("version") != 1 or type(doc.get("version")) is not int:
        raise _Newer(f"version {doc.get('version')!r} is not one this ckptd knows")
    if set(doc) != fields:
        raise ValueError(f"fields {sorted(set(doc) ^ fields)} are not those of {fmt}")
    return doc


def _commit_record(data: bytes) -> tuple[str, int, list[str], int, int]:
    """(job, step, manifest hashes by rank, their bytes summed, logical bytes)."""
    doc = _document(data, "ckptd.commit", _RECORD_FIELDS)
    refs, report = doc["manifests"], doc["report"]
    world = doc["world_size"]
    if not (isinstance(doc["job"], str) and _is_int(doc["step"]) and _is_int(world, 1)
            and isinstance(refs, list) and len(refs) == world and isinstance(report, dict)
            and _is_int(report.get("logical_bytes"))):
        raise ValueError("a field has the wrong type")
    hashes, total = [], 0
    for rank, ref in enumerate(refs):
        if not (isinstance(ref, dict) and ref.get("rank") == rank and _is_int(ref.get("size"))
                and isinstance(ref.get("hash"), str) and len(ref["hash"]) == 64):
            raise ValueError(f"manifests[{rank}] is not rank {rank}'s")
        hashes.append(ref["hash"])
        total += ref["size"]
    return doc["job"], doc["step"], hashes, total, report["logical_bytes"]


@dataclass(slots=True)
class _Counted:
    digest: str
    logical_bytes: int
    ids: np.ndarray  # uint64, ascending, distinct
    sizes: np.ndarray  # uint32, beside ids


@dataclass(slots=True)
class _Open:
    """A step being counted: its record's manifest hashes, and the distinct chunks
    of the ranks read so far."""

    hashes: list[str]  # of the rank manifests, by rank
    logical_bytes: int
    digest: str
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    sizes: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint32))
    damaged: bool = False


def _distinct(ids: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep, first = np.unique(ids, return_index=True)
    return keep, sizes[first]


def manifest_chunks(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(id prefixes, sizes) of every chunk a rank manifest's entries name, distinct.

    Canonical bytes (sorted keys: ``chunk_size`` first, then ``entries``) are read
    an entry at a time and nothing after the entries is parsed; anything else is
    parsed whole. ``BookError`` for a manifest that is not one."""
    text = data.decode("utf-8", errors="strict")
    ids, sizes = array("Q"), array("I")
    head = '{"chunk_size":'
    try:
        # (canonical: the document's last keys are "version", then "world_size")
        tail = _MANIFEST_TAIL.search(text, max(0, len(text) - 64))
        if text.startswith(head) and tail is not None:
            if tail[1] != "1":
                raise _Newer(f"version {tail[1]} is not one this ckptd knows")
            at = text.index(",", len(head))
            chunk_size = int(text[len(head):at])
            if not text.startswith(',"entries":[', at):
                raise ValueError("no entries after chunk_size")
            at += len(',"entries":[')
            decoder = json.JSONDecoder()
            if text[at] != "]":
                while True:
                    entry, at = decoder.raw_decode(text, at)
                    _add_entry(entry, chunk_size, ids, sizes)
                    at += 1
                    if text[at - 1] == "]":
                        break
                    if text[at - 1] != ",":
                        raise ValueError(f"unexpected {text[at - 1]!r} between entries")
        else:
            doc = json.loads(text)
            if type(doc["version"]) is not int or doc["version"] != 1:
                raise _Newer(f"version {doc['version']!r} is not one this ckptd knows")
            chunk_size = doc["chunk_size"]
            for entry in doc["entries"]:
                _add_entry(entry, chunk_size, ids, sizes)
    except _Newer:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise BookError(f"not a rank manifest ({type(exc).__name__}: {exc})") from None
    return _distinct(np.frombuffer(ids, np.uint64), np.frombuffer(sizes, np.uint32))


def _add_entry(entry: object, chunk_size: object, ids: array[int], sizes: array[int]) -> None:
    if not isinstance(entry, dict):
        raise TypeError("an entry is not an object")
    chunks, nbytes = entry["chunks"], entry["nbytes"]
    if type(chunk_size) is not int or chunk_size <= 0 or type(nbytes) is not int:
        raise TypeError("chunk_size and nbytes are not positive integers")
    if not isinstance(chunks, list) or not all(isinstance(c, str) and len(c) == 64
                                               for c in chunks):
        raise TypeError("chunks is not a list of chunk ids")
    last = len(chunks) - 1
    for i, cid in enumerate(chunks):
        ids.append(int(cid[:16], 16))
        sizes.append(chunk_size if i < last else nbytes - chunk_size * last)


class SpaceBook:
    """Counted steps, by (job, step), and the views computed from them."""

    def __init__(self) -> None:
        self._counted: dict[tuple[str, int], _Counted] = {}
        self._open: dict[tuple[str, int], _Open] = {}
        self._view: BookView | None = None
        self._distinct = np.empty(0, np.uint64)  # what the last view found referenced
        self._mark: np.ndarray | None = None  # ids chunks/ held when last listed
        # Chunks that dropped (forgotten) or replaced counts named, not in the mark:
        # still in the store until a collection deletes them, so still counted.
        self._orphans = _empty()
        # Those orphaned since the listing under way began (or since this book was
        # made): the only ones that listing may have missed (``listing``).
        self._orphans_since = _empty()

    # -- counting a step: begin, then either load its summary, or add every rank and finish

    def begin(self, job: str, step: int, record_bytes: bytes, key: str) -> Begun:
        """Opens the count of a step from its commit record's bytes (read at ``key``)."""
        try:
            named, number, hashes, total, logical = _commit_record(record_bytes)
        except _Newer as exc:
            raise BookError(f"{key}: {exc}; it was written by a newer ckptd") from None
        except (ValueError, KeyError) as exc:
            raise BookError(f"damaged document {key}: {exc}") from None
        if (named, number) != (job, step):
            raise BookError(f"damaged document {key}: the commit record names step {number} "
                            f"of {named}")
        digest = blake3.blake3(record_bytes).hexdigest()
        self._open[(job, step)] = _Open(hashes, logical, digest)
        return Begun(len(hashes), total, digest)

    def add_ranks(self, job: str, step: int,
                  ranks: list[tuple[int, bytes | None, str | None, str]]) -> list[str]:
        """``add_rank`` of each (rank, bytes, path, key); what was wrong, in order."""
        found = (self.add_rank(job, step, *item) for item in ranks)
        return [problem for problem in found if problem is not None]

    def add_rank(self, job: str, step: int, rank: int, data: bytes | None, path: str | None,
                 key: str) -> str | None:
        """Counts one rank's manifest (its bytes, or the file at ``path`` on this
        host); what is wrong with it, or None. A rank that does not verify against
        the record is left out, and the step is counted without it."""
        held = self._open[(job, step)]
        if data is None and path is not None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                data = None
        if data is None:
            held.damaged = True
            return f"damaged step: {key}, named by its commit record, is missing"
        if blake3.blake3(data).hexdigest() != held.hashes[rank]:
            held.damaged = True
            return f"damaged document {key}: its bytes are not those its commit record names"
        try:
            ids, sizes = manifest_chunks(data)
        except _Newer as exc:  # (its entries may mean something else: not counted)
            held.damaged = True
            return f"{key}: rank manifest {exc}; it was written by a newer ckptd: upgrade ckptd"
        except BookError as exc:
            held.damaged = True
            return f"damaged document {key}: {exc}"
        held.ids, held.sizes = _distinct(np.concatenate([held.ids, ids]),
                                         np.concatenate([held.sizes, sizes]))
        return None

    def finish(self, job: str, step: int, summary: bool) -> bytes | None:
        """Counts the opened step; its summary's bytes when asked for (never for a
        step with a damaged rank: the next count may read that rank again)."""
        held = self._open.pop((job, step))
        self._put(job, step, _Counted(held.digest, held.logical_bytes, held.ids, held.sizes))
        if not summary or held.damaged:
            return None
        return canonical({
            "format": SPACE_FORMAT, "version": 1, "job": job, "step": step,
            "commit": held.digest, "logical_bytes": held.logical_bytes,
            "chunks": len(held.ids), "chunk_bytes": int(held.sizes.sum(dtype=np.uint64)),
            "ids": base64.b64encode(held.ids.astype(_IDS).tobytes()).decode("ascii"),
            "sizes": base64.b64encode(held.sizes.astype(_SIZES).tobytes()).decode("ascii"),
        })

    def load(self, job: str, step: int, data: bytes) -> tuple[str, bool] | None:
        """Counts the opened step from its space summary; None, or what is wrong with
        the summary and whether to replace it (not one of a newer ckptd). The step
        is then to be counted from its manifests."""
        held = self._open[(job, step)]
        try:
            doc = _document(data, SPACE_FORMAT, _SUMMARY_FIELDS)
            ids = np.frombuffer(base64.b64decode(doc["ids"], validate=True), _IDS)
            sizes = np.frombuffer(base64.b64decode(doc["sizes"], validate=True), _SIZES)
        except _Newer as exc:
            return f"{exc}: a newer ckptd's", False
        except (ValueError, TypeError) as exc:
            return f"damaged: {exc}", True
        if (doc["job"], doc["step"], doc["commit"]) != (job, step, held.digest):
            return "it counts another commit of the step", True
        if not (_is_int(doc["logical_bytes"]) and doc["chunks"] == len(ids) == len(sizes)
                and doc["chunk_bytes"] == int(sizes.sum(dtype=np.uint64))
                and (len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1])))):
            return "damaged: its arrays do not hold its chunks, ascending", True
        del self._open[(job, step)]
        self._put(job, step, _Counted(held.digest, doc["logical_bytes"],
                                      ids.astype(np.uint64), sizes.astype(np.uint32)))
        return None

    def abort(self, job: str, step: int) -> None:
        self._open.pop((job, step), None)

    def _put(self, job: str, step: int, counted: _Counted) -> None:
        was = self._counted.get((job, step))
        if was is not None and was.digest != counted.digest:
            self._orphan(was)  # (another commit under the step's number)
        self._counted[(job, step)] = counted
        self._view = None

    def drop(self, keys: list[tuple[str, int]]) -> None:
        for job, step in keys:
            if (was := self._counted.pop((job, step), None)) is not None:
                self._orphan(was)
                self._view = None

    def _orphan(self, counted: _Counted) -> None:
        """A count goes: its chunks stay in the store until a collection, so they
        stay in the chunk totals until the next listing says otherwise."""
        ids, sizes = counted.ids, counted.sizes
        if self._mark is not None:
            new = ~np.isin(ids, self._mark, assume_unique=True)
            ids, sizes = ids[new], sizes[new]
        self._orphans = _union(self._orphans, (ids, sizes))
        self._orphans_since = _union(self._orphans_since, (ids, sizes))

    def clear(self) -> None:
        self._counted.clear()
        self._open.clear()
        self._view = None
        self._mark = None
        self._orphans = self._orphans_since = _empty()

    # -- chunks stored since chunks/ was listed

    def listing(self) -> None:
        """A listing of chunks/ begins: a chunk orphaned before now was in the store
        before it began, so the listing finds it unless it was deleted."""
        self._orphans_since = _empty()

    def listed(self, ids: bytes | None) -> None:
        """chunks/ was listed: these ids (8 bytes each, as in a summary) were in it;
        None: what the counted steps name now (a collection's count, which deleted
        every chunk orphaned before it). Chunks that steps counted later name, or
        that counts orphaned since the listing began, and the listing lacked, are
        the ones stored since."""
        if ids is None:
            self._mark = self.view_distinct()
            self._orphans = _empty()
        else:
            self._mark = np.unique(np.frombuffer(ids, _IDS).astype(np.uint64))
            since, sizes = self._orphans_since
            new = ~np.isin(since, self._mark, assume_unique=True)
            self._orphans = (since[new], sizes[new])
        self._orphans_since = _empty()
        self._view = None

    def view_distinct(self) -> np.ndarray:
        self.view()
        return self._distinct

    # -- the view

    def view(self) -> BookView:
        """Bytes per job (its steps' distinct chunks), per step (the chunks no other
        counted step names: what forgetting it frees), and in all."""
        if self._view is not None:
            return self._view
        keys = sorted(self._counted)
        if not keys:
            self._distinct = np.empty(0, np.uint64)
            orphans, orphan_sizes = self._orphans
            self._view = BookView((), 0, 0, 0, len(orphans), int(orphan_sizes.sum(dtype=np.int64)))
            return self._view
        counted = [self._counted[k] for k in keys]
        lengths = np.array([len(c.ids) for c in counted], dtype=np.int64)
        ids = np.concatenate([c.ids for c in counted])
        sizes = np.concatenate([c.sizes for c in counted]).astype(np.int64)
        owner = np.repeat(np.arange(len(keys)), lengths)
        distinct, first, inverse, refs = np.unique(
            ids, return_index=True, return_inverse=True, return_counts=True)
        alone = refs[inverse] == 1
        unique = np.bincount(owner[alone], weights=sizes[alone], minlength=len(keys))
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        jobs: list[JobView] = []
        start = 0
        for job in sorted({j for j, _ in keys}):  # (keys are sorted: a job's are together)
            end = start
            while end < len(keys) and keys[end][0] == job:
                end += 1
            lo, hi = int(bounds[start]), int(bounds[end])
            _, at = np.unique(ids[lo:hi], return_index=True)
            steps = tuple((keys[i][1], counted[i].logical_bytes, int(unique[i]))
                          for i in range(start, end))
            jobs.append(JobView(job, int(sizes[lo:hi][at].sum()),
                                sum(s[1] for s in steps), steps))
            start = end
        self._distinct = distinct
        new = (np.ones(len(distinct), bool) if self._mark is None
               else ~np.isin(distinct, self._mark, assume_unique=True))
        # (orphans are not in the mark; those a counted step names again are above)
        orphans, orphan_sizes = self._orphans
        gone = ~np.isin(orphans, distinct, assume_unique=True)
        orphan_bytes = int(orphan_sizes[gone].sum(dtype=np.int64))
        self._view = BookView(tuple(jobs), len(distinct), int(sizes[first].sum()), len(ids),
                              int(new.sum()) + int(gone.sum()),
                              int(sizes[first][new].sum()) + orphan_bytes)
        return self._view


def _empty() -> tuple[np.ndarray, np.ndarray]:
    return np.empty(0, np.uint64), np.empty(0, np.uint32)


def _union(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
           ) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (ids, sizes) of both, ids ascending."""
    return _distinct(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
