"""JSON for large documents: a depth check that needs no parser, and decoding and
encoding in pieces, so that a thread working on a 100,000-tensor manifest gives
the GIL (and so the server's event loop) back between pieces. One ``json.loads``
or ``json.dumps`` call over 24 MiB held it for all of its length."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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
        while True:
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
