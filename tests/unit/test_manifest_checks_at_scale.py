"""The shortcuts a large manifest's checks take (an entry geometry checked once,
all chunk ids matched at once, tensor leaves of the tree checked inline) refuse
everything the entry-by-entry checks refused."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.errors import InvalidDocument
from ckptd.format import MAX_TREE_DEPTH, PARSE_SLICE, check_tree
from tests.unit.test_format import entry_doc, parse, with_entries


@pytest.mark.parametrize("count", [3, PARSE_SLICE + 3])  # (the whole and the sliced parse)
@pytest.mark.parametrize(("change", "words"), [
    ({"chunks": ["A" * 64] * 12}, "bad chunk id"),
    ({"chunks": ["0" * 63 + "g"] * 12}, "bad chunk id"),
    ({"chunks": ["0" * 64] * 11 + ["0" * 65]}, "bad chunk id"),
    ({"nbytes": 47996}, "nbytes"),
    ({"placement": "sharded", "offsets": [1, 0]}, "outside"),
])
def test_a_bad_last_entry_among_good_ones_of_its_geometry(
    count: int, change: dict[str, Any], words: str
) -> None:
    entries = [entry_doc(name=f"w{i}") for i in range(count - 1)]
    entries.append(entry_doc(name="last", **change))
    with pytest.raises(InvalidDocument) as info:
        parse(with_entries(*entries))
    assert words in str(info.value)
    if words == "bad chunk id":
        assert "'last'" in str(info.value)  # the entry is named
    parse(with_entries(*entries[:-1]))  # the good ones alone pass


def test_a_tensor_leaf_below_the_depth_limit_is_refused() -> None:
    node: Any = {"tensor": "w"}
    for _ in range(MAX_TREE_DEPTH):
        node = {"list": [node]}
    check_tree(node, set())
    with pytest.raises(InvalidDocument, match="deeper"):
        check_tree({"list": [node]}, set())
    pairs: Any = {"tensor": "w"}
    for _ in range(MAX_TREE_DEPTH + 1):
        pairs = {"dict": [["k", pairs]]}
    with pytest.raises(InvalidDocument, match="deeper"):
        check_tree(pairs, set())


@pytest.mark.parametrize("leaf", [{"tensor": 5}, {"tensor": "w", "x": 1}, {"tensor": None}])
def test_malformed_tensor_leaves_are_refused(leaf: Any) -> None:
    with pytest.raises(InvalidDocument):
        check_tree({"dict": [["k", leaf]]}, set())
    with pytest.raises(InvalidDocument, match="twice"):
        check_tree({"list": [{"tensor": "w"}, {"tensor": "w"}]}, set())
