"""JSON for large documents: a depth check that needs no parser, decoding and
encoding in pieces, so that a thread working on a 100,000-tensor manifest gives
the GIL (and so the server's event loop) back between pieces (one ``json.loads``
or ``json.dumps`` call over 24 MiB held it for all of its length), and keeping
the documents a server holds out of the cyclic garbage collector's scans."""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Items (tensor entries, tree pairs) encoded per call.
SLICE = 2_000


def _refuse_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity; canonical JSON has no such tokens.
    raise ValueError(f"{name} is not JSON")


def _canonical(obj: Any) -> bytes:
    # ckptd.format.canonical_json's encoding (that module imports this one).
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_too_deep(data: bytes | bytearray | memoryview, limit: int) -> bool:
    """Whether JSON ``data`` nests deeper than ``limit``, found without parsing
    it (a parser recurses: 100,000 ``[`` is a RecursionError, not an answer).

    Innermost bracket pairs are removed level by level, at C speed. Brackets
    inside strings count too (balanced ones only add pairs); text that stops
    shrinking is left to the parser, whose RecursionError is caught as well."""
    brackets = bytes(data).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(shorter) == len(brackets):
            return False
        brackets = shorter
    return bool(brackets)


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_WS = re.compile(r"[ \t\n\r]*")
# Array elements are decoded in runs of about this many characters, one C call
# each (a few ms): one call per element spent most of a large manifest's decoding
# in the Python loop around it.
BATCH_CHARS = 256 * 1024
# Where an element that is an object (an array) may end and the next one begin.
_ELEMENT_END = {"{": re.compile(r"}[ \t\n\r]*,[ \t\n\r]*{"),
                "[": re.compile(r"][ \t\n\r]*,[ \t\n\r]*\[")}


def decode_piecewise(text: str) -> Any:
    """``json.loads(text)``, decoded one array element (one tensor entry, one tree
    pair) per call: a thread decoding 24 MiB in one call held the GIL, and so the
    event loop, for all of it."""
    value, end = _decode_at(text, _WS.match(text, 0).end(), 0)  # type: ignore[union-attr]
    if _WS.match(text, end).end() != len(text):  # type: ignore[union-attr]
        raise ValueError(f"extra data at {end}")
    return value


def _decode_at(text: str, idx: int, depth: int) -> tuple[Any, int]:
    # Objects are walked at depths 0 and 1 (the document, its entries/tree/meta),
    # arrays down to depth 2 (the tree's list of pairs); the rest in one call each.
    ch = text[idx:idx + 1]
    if ch == "[" and depth <= 2:
        items: list[Any] = []
        idx = _WS.match(text, idx + 1).end()  # type: ignore[union-attr]
        if text[idx:idx + 1] == "]":
            return items, idx + 1
        tried = idx  # the end of the last run that did not decode
        while True:
            if idx >= tried:
                run, tried = _decode_run(text, idx)
                if run is not None:  # a run of whole elements, and a ',' after them
                    items.extend(run)
                    scan_so_far()
                    idx = _WS.match(text, tried).end() + 1  # type: ignore[union-attr]
                    idx = _WS.match(text, idx).end()  # type: ignore[union-attr]
                    continue
            item, idx = _decode_at(text, idx, depth + 1)
            items.append(item)
            idx = _WS.match(text, idx).end()  # type: ignore[union-attr]
            sep = text[idx:idx + 1]
            idx = _WS.match(text, idx + 1).end()  # type: ignore[union-attr]
            if sep == "]":
                return items, idx
            if sep != ",":
                raise ValueError(f"expected ',' or ']' at {idx}")
    if ch == "{" and depth <= 1:
        obj: dict[str, Any] = {}
        idx = _WS.match(text, idx + 1).end()  # type: ignore[union-attr]
        if text[idx:idx + 1] == "}":
            return obj, idx + 1
        while True:
            key, idx = _DECODER.raw_decode(text, idx)
            if not isinstance(key, str):
                raise ValueError(f"expected a key at {idx}")
            idx = _WS.match(text, idx).end()  # type: ignore[union-attr]
            if text[idx:idx + 1] != ":":
                raise ValueError(f"expected ':' at {idx}")
            idx = _WS.match(text, idx + 1).end()  # type: ignore[union-attr]
            obj[key], idx = _decode_at(text, idx, depth + 1)
            idx = _WS.match(text, idx).end()  # type: ignore[union-attr]
            sep = text[idx:idx + 1]
            idx = _WS.match(text, idx + 1).end()  # type: ignore[union-attr]
            if sep == "}":
                return obj, idx
            if sep != ",":
                raise ValueError(f"expected ',' or '}}' at {idx}")
    return _DECODER.raw_decode(text, idx)


def _decode_run(text: str, idx: int) -> tuple[list[Any] | None, int]:
    """The array elements from ``idx`` to an element end about BATCH_CHARS on,
    decoded in one call, and where they end; None (and that end) when the text up
    to there is not a run of whole elements.

    A JSON object, array or string ends where its own text says, so when the
    stretch decodes as a list its elements are exactly what decoding one at a
    time finds (the stretch ends at a '}' or ']', never inside a number)."""
    pattern = _ELEMENT_END.get(text[idx:idx + 1])
    found = None if pattern is None else pattern.search(text, idx + BATCH_CHARS)
    if found is None:
        return None, len(text)
    end = found.start() + 1
    try:
        run = _DECODER.decode("[" + text[idx:end] + "]")
    except ValueError:
        return None, end  # (a '}' inside a string, the array's own end): one at a time
    return run, end


def encode_sliced(items: list[Any], dump: Callable[[list[Any]], Any] = lambda s: s) -> bytes:
    """``_canonical(dump(items))``, dumped and encoded SLICE items per call."""
    parts = [_canonical(dump(items[i:i + SLICE]))[1:-1]
             for i in range(0, len(items), SLICE)]
    return b"[" + b",".join(p for p in parts if p) + b"]"


def encode_tree(tree: Any) -> bytes:
    """``_canonical(tree)``, its top node's (long) list encoded in slices."""
    if isinstance(tree, dict) and len(tree) == 1:
        ((kind, body),) = tree.items()
        if isinstance(body, list) and len(body) > SLICE:
            return b"{" + _canonical(kind) + b":" + encode_sliced(body) + b"}"
    return _canonical(tree)


# -- large documents and the cyclic garbage collector ---------------------------------
#
# A parsed 100,000-tensor manifest is about 700,000 container objects. CPython's
# collector (3.11, not incremental) scans every tracked object of the oldest
# generation in one pass that holds the GIL: building such a manifest set off
# full collections of 0.3-1.7 s, and every manifest kept in the parsed cache made
# each later one longer. A server builds its large documents with the collector
# paused, then freezes them (``gc.freeze``): kept documents are never scanned
# again, and are still freed by reference counting when dropped (they hold no
# reference cycles). What freezing would leak is cyclic garbage alive at that
# moment (closed connections, finished requests, errors): the youngest generation
# is collected at a pause's end (what the pause made, the documents with it), and
# the frozen set is compacted now and then (below). No full collection before a
# pause's freeze (it measured 0.1 s more than the youngest generation's after a
# 64-rank step); smaller documents, built with the collector running, are frozen
# in batches after a collection of what is not frozen (``freeze_what_survives``),
# so that no full pass of the collector scans a cache of them.

_pause_lock = threading.Lock()
_pauses = 0
_was_enabled = False
_built = False  # a body finished since the collector was paused: freeze its work
# A bound on what freezing could keep that is not a document: once the frozen set
# grows past this many objects and thrice its size after the last compaction, it
# is unfrozen and collected once (one full scan, about 1 s per 2,000,000 objects)
# and frozen again. Kept documents alone grow it that far at most once or twice
# in a server's life (the parsed cache holds at most ~7,000,000 objects).
COMPACT_FROM = 4_000_000
COMPACT_EVERY_S = 600.0
_compacted_at = 0
# (from the process's start: a compaction at its first large document was a full
# collection of everything the server had built, 0.25 s with the GIL held)
_compacted_time = time.monotonic()
_compaction_s = 0.0  # how long the last one took
_counted = 0  # the frozen set's size when last counted
_frozen_since = 0  # objects frozen since (some may be freed by now)


@contextmanager
def documents_kept_from_collector() -> Iterator[None]:
    """Runs the body with the cyclic collector paused and freezes what it built
    (see above); nests, and several threads may hold it at once. A body that
    raises freezes nothing: a refused document is garbage, and a stream of them
    must not freeze what else the server made meanwhile."""
    with _collector_paused(keep=True):
        yield


@contextmanager
def collector_paused() -> Iterator[None]:
    """Runs the body with the cyclic collector paused, freezing nothing of its own:
    for documents parsed and dropped again (a garbage collection's mark reads
    every manifest; its objects go by reference count, with no collection
    scanning them meanwhile)."""
    with _collector_paused(keep=False):
        yield


@contextmanager
def _collector_paused(keep: bool) -> Iterator[None]:
    global _pauses, _was_enabled, _built
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    finished = False
    try:
        yield
        finished = True
    finally:
        with _pause_lock:
            _pauses -= 1
            _built = _built or (finished and keep)
            if _pauses == 0:
                if _built:
                    # While the collector was paused, the other threads went on: the
                    # connections they closed and the requests they finished are
                    # cyclic garbage, in the youngest generation with the documents
                    # (nothing is promoted while it is paused), and a freeze now would
                    # keep it (with a closed upload's buffer, megabytes) for good.
                    # One scan of what the pause made: the documents once, then never.
                    gc.collect(0)
                    _freeze()  # (moves the generations' lists: no scan, no pause)
                    _compact_if_grown()
                _built = False
                if _was_enabled:
                    gc.enable()


def scan_so_far() -> None:
    """Inside a pause of the collector: one scan of its youngest generation now, of
    what was built since the last call (a piece of a document), so that the scan at
    the pause's end is of the last piece only: at a 100,000-tensor manifest's end
    it was 0.15 s with the GIL held, in pieces it is a few milliseconds each. What
    survives moves to the middle generation, which a keeping pause freezes with the
    rest; nothing is frozen here (a refused document freezes nothing). Outside a
    pause, nothing."""
    if _pauses:  # (read without the lock: a scan more or less is harmless)
        gc.collect(0)


def freeze_what_survives() -> None:
    """Collects every object not frozen yet, then freezes what survived: documents
    built with the collector running (manifests under KEEP_FROZEN_FROM) are frozen
    this way in batches, so that what the collector's full passes scan stays about
    one batch (a server's cache of 64 small manifests of 2,000 tensors each made
    every full pass 0.4 s, growing with the cache: /healthz unanswered meanwhile).
    The collection scans only what is not frozen (the batch, and the process's
    other young objects), so it frees the cyclic garbage among them instead of
    freezing it; a pause under way freezes at its own end."""
    global _built
    with _pause_lock:
        if _pauses:
            _built = True
            return
        gc.collect()
        _freeze()
        _compact_if_grown()


def _compact_if_grown() -> None:
    """Collects the frozen set once it has grown past the bound above (called with
    the pause lock held, right after a freeze)."""
    global _counted, _frozen_since
    now = time.monotonic()
    # Also now and then whatever its size: objects alive at a freeze (connections,
    # requests) that died in a cycle since are frozen garbage, few but holding
    # buffers. The scan costs about 1 s per 2,000,000 objects, so at most every
    # COMPACT_EVERY_S seconds and 200 times its own last duration.
    if now - _compacted_time < max(COMPACT_EVERY_S, 200 * _compaction_s):
        # Counting walks the frozen set (0.6 s with the GIL held for a full
        # cache's 3,500,000 objects here, where a batch of small manifests is
        # frozen every few seconds): only once what was frozen since the last
        # count could have taken it past the bound (frozen objects freed since are
        # not subtracted: the sum is at least the set's size), and twice as much
        # was frozen since as the set held then, so that a set held near its
        # bound by a cache that turns over is counted once per twice its size
        # frozen anew (an overshoot of the bound by as much, at most).
        bound = max(COMPACT_FROM, 3 * _compacted_at)
        if _counted + _frozen_since < bound or _frozen_since < 2 * _counted:
            return
        _counted, _frozen_since = gc.get_freeze_count(), 0
        if _counted < bound:
            return
    _compact(now)


def _freeze() -> None:
    """``gc.freeze()``, adding what it freezes to ``_frozen_since`` (a list of the
    objects not frozen yet: the documents just built, a batch, milliseconds)."""
    global _frozen_since
    _frozen_since += sum(len(gc.get_objects(g)) for g in range(3))
    gc.freeze()


def _compact(now: float) -> None:
    global _compacted_at, _compacted_time, _compaction_s, _counted, _frozen_since
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _compacted_at = _counted = gc.get_freeze_count()
    _frozen_since = 0
    _compacted_time = time.monotonic()
    _compaction_s = _compacted_time - now
