"""Format v1: names, keys, canonical JSON, and what a reader refuses."""

from __future__ import annotations

import json
import math
from typing import Any

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd import dtypes
from ckptd.errors import InvalidDocument, InvalidName, UnsupportedFormat
from ckptd.format import (
    FORMAT_VERSION,
    MAX_STEP,
    MAX_TREE_DEPTH,
    CommitRecord,
    ManifestRef,
    RankManifest,
    Ref,
    Timeline,
    ValidationReport,
    canonical_json,
    check_chunk_id,
    check_job,
    check_rank,
    check_step,
    check_tree,
    check_world_size,
    chunk_key,
    commit_key,
    latest_key,
    manifest_epoch,
    manifest_key,
    step_prefix,
    timeline_key,
)
from ckptd.hashing import chunk_count, chunk_id, chunk_spans
from ckptd.testing.manifests import demo_step, flat_tree, rank_manifest, replace, tensor_entry

CID = "0" * 64


def manifest_doc(**changes: Any) -> dict[str, Any]:
    """A valid rank manifest as a JSON object, with fields changed."""
    m, _ = demo_step("job", 3, 2)[1]
    doc = json.loads(m.canonical())
    doc.update(changes)
    return doc


def parse(doc: dict[str, Any]) -> RankManifest:
    return RankManifest.parse(json.dumps(doc).encode())


def entry_doc(**changes: Any) -> dict[str, Any]:
    e, _ = tensor_entry("w", "float32", [4, 3000])  # 48000 bytes: 12 chunks of 4096
    doc = json.loads(e.canonical())
    doc.update(changes)
    return doc


def with_entries(*entries: dict[str, Any], tree: Any = None) -> dict[str, Any]:
    return manifest_doc(
        entries=list(entries),
        tree=tree if tree is not None else flat_tree(e["name"] for e in entries),
    )


# -- keys and names ------------------------------------------------------------------------


def test_keys_are_the_documented_layout() -> None:
    cid = chunk_id(b"x")
    assert chunk_key(cid) == f"chunks/{cid[:2]}/{cid}"
    assert step_prefix("j", 7) == "jobs/j/steps/7/"
    assert manifest_key("j", 7, 3) == "jobs/j/steps/7/ranks/3.json"
    assert commit_key("j", 7) == "jobs/j/steps/7/commit.json"
    assert latest_key("j") == "jobs/j/refs/latest"
    assert timeline_key("j") == "jobs/j/refs/timeline"
    assert manifest_key("j", 0, 0) == "jobs/j/steps/0/ranks/0.json"  # no zero padding


@pytest.mark.parametrize("job", ["a", "A9", "llama-70b.run_3", "x" * 128, "9lives"])
def test_good_job_names(job: str) -> None:
    assert check_job(job) == job


@pytest.mark.parametrize(
    "job",
    ["", "../x", "..", ".hidden", "-x", "_x", "a/b", "a b", "x" * 129, "résumé", "a\n", 7, None],
)
def test_bad_job_names(job: Any) -> None:
    with pytest.raises(InvalidName):
        check_job(job)
    with pytest.raises(InvalidName):
        latest_key(job)


@pytest.mark.parametrize(
    "cid", ["", "0" * 63, "0" * 65, "A" * 64, "g" * 64, "../" + "0" * 61, "0" * 64 + "\n", 5]
)
def test_bad_chunk_ids(cid: Any) -> None:
    with pytest.raises(InvalidName):
        check_chunk_id(cid)
    with pytest.raises(InvalidName):
        chunk_key(cid)


def test_steps_ranks_and_world_sizes() -> None:
    assert check_step(0) == 0
    assert check_step(MAX_STEP - 1) == MAX_STEP - 1
    for bad in (-1, MAX_STEP, True, 1.0, "1", None):
        with pytest.raises(InvalidName):
            check_step(bad)  # type: ignore[arg-type]
    assert check_rank(3, 4) == 3
    for rank, world in ((4, 4), (-1, 4), (True, 4), (0, 0)):
        with pytest.raises(InvalidName):
            check_rank(rank, world)
    with pytest.raises(InvalidName):
        check_world_size((1 << 20) + 1)
    # A numpy integer is named, with what to pass instead (found by a probe).
    numpy = pytest.importorskip("numpy")
    with pytest.raises(InvalidName, match=r"a numpy.int64: pass int\(step\)"):
        check_step(numpy.int64(7))  # type: ignore[arg-type]


# -- canonical JSON ------------------------------------------------------------------------


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical_json({"b": 1, "a": [1, 2.5, None, True], "é": "ü"}) == (
        '{"a":[1,2.5,null,true],"b":1,"é":"ü"}'.encode()
    )
    assert canonical_json({"x": 1, "y": 2}) == canonical_json({"y": 2, "x": 1})
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            canonical_json({"x": bad})


def test_manifest_bytes_are_stable() -> None:
    a, _ = demo_step("job", 3, 2)[1]
    b, _ = demo_step("job", 3, 2)[1]
    assert a.canonical() == b.canonical()
    assert a.digest() == b.digest() == blake3.blake3(a.canonical()).hexdigest()
    reparsed = RankManifest.parse(a.canonical())
    assert reparsed == a
    assert reparsed.canonical() == a.canonical()
    # a reordered, indented encoding of the same document parses to the same bytes
    pretty = json.dumps(json.loads(a.canonical()), indent=2, sort_keys=False).encode()
    assert RankManifest.parse(pretty).canonical() == a.canonical()
    doc = json.loads(a.canonical())
    assert doc["format"] == "ckptd.rank_manifest" and doc["version"] == FORMAT_VERSION


def test_a_committed_manifest_keeps_its_checked_bytes_as_its_encoding() -> None:
    """Bytes read back and checked against a commit record's digest are the canonical
    encoding that digest was taken of: kept as such, not encoded again (a restore's
    plan parses its manifest this way); the checks still run."""
    a, _ = demo_step("job", 3, 2)[1]
    stored = bytes(a.canonical())  # (another object than a's own encoding)
    committed = RankManifest.parse(stored, a.digest())
    assert committed == a
    assert committed.canonical() is stored and committed.digest() == a.digest()
    assert RankManifest.parse(stored).canonical() is not stored  # (encoded anew)
    doc = json.loads(stored)
    doc["entries"][0]["nbytes"] = -1  # checked all the same
    with pytest.raises(InvalidDocument):
        RankManifest.parse(canonical_json(doc), a.digest())
    # A lone surrogate in the tree has no canonical encoding: refused, even from
    # bytes that match a digest (a damaged or hostile store's).
    doc = json.loads(stored)
    doc["tree"]["dict"].append(["odd", {"value": "\ud800"}])
    bad = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert b"\\ud800" in bad
    with pytest.raises(InvalidDocument, match="canonical"):
        RankManifest.parse(bad, blake3.blake3(bad).hexdigest())


def test_commit_record_and_ref_bytes() -> None:
    report = ValidationReport(
        tensors=1, logical_bytes=8, chunks=1, replicated_entries=1, sharded_entries=0,
        local_entries=0,
    )
    record = CommitRecord(
        job="j", step=2, world_size=1, manifests=[ManifestRef(rank=0, hash=CID, size=10)],
        report=report, committed_at=1700000000.0,
    )
    assert record.canonical() == (
        b'{"committed_at":1700000000.0,"format":"ckptd.commit","job":"j","manifests":'
        b'[{"hash":"' + CID.encode() + b'","rank":0,"size":10}],"meta":{},"report":'
        b'{"chunks":1,"local_entries":0,"logical_bytes":8,"replicated_entries":1,'
        b'"sharded_entries":0,"tensors":1,"warnings":[]},"step":2,"version":1,"world_size":1}'
    )
    assert CommitRecord.parse(record.canonical()) == record
    # A record of no ranks names no manifest "in order" trivially: refused all the same.
    empty = record.model_copy(update={"world_size": 0, "manifests": []})
    with pytest.raises(InvalidDocument, match="world_size 0"):
        CommitRecord.parse(empty.canonical())
    ref = Ref(step=2, commit=record.digest())
    assert ref.canonical() == (
        b'{"commit":"' + record.digest().encode() + b'","format":"ckptd.ref","step":2,"version":1}'
    )
    assert Ref.parse(ref.canonical()) == ref


# -- versions and headers ------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 0, None, "1", 1.0, True, 1.5])
def test_unknown_versions_are_refused(version: Any) -> None:
    doc = manifest_doc(version=version)
    with pytest.raises(UnsupportedFormat) as info:
        parse(doc)
    assert info.value.code == "unsupported_format"
    assert isinstance(info.value, InvalidDocument)
    del doc["version"]
    with pytest.raises(UnsupportedFormat):
        parse(doc)


def test_commit_and_ref_refuse_unknown_versions() -> None:
    ref = json.loads(Ref(step=1, commit=CID).canonical())
    ref["version"] = 2
    with pytest.raises(UnsupportedFormat):
        Ref.parse(json.dumps(ref).encode())
    rec = {"format": "ckptd.commit", "version": 2, "anything": "else"}
    with pytest.raises(UnsupportedFormat):
        CommitRecord.parse(json.dumps(rec).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'"string"',
        b"\xff\xfe",
        b'{"format":"ckptd.commit","version":1}',  # a commit record is not a manifest
    ],
)
def test_non_manifests_are_refused(data: bytes) -> None:
    with pytest.raises(InvalidDocument):
        RankManifest.parse(data)


def test_nan_tokens_are_refused() -> None:
    raw = json.dumps(manifest_doc(meta={"lr": 1.0})).replace("1.0", "NaN").encode()
    assert b"NaN" in raw
    with pytest.raises(InvalidDocument):
        RankManifest.parse(raw)
    raw = json.dumps(manifest_doc(tree={"value": 0.5})).replace("0.5", "Infinity").encode()
    with pytest.raises(InvalidDocument):
        RankManifest.parse(raw)


def test_unknown_and_missing_fields_are_refused() -> None:
    with pytest.raises(InvalidDocument):
        parse(manifest_doc(extra=1))
    doc = manifest_doc()
    del doc["chunk_size"]
    with pytest.raises(InvalidDocument):
        parse(doc)
    with pytest.raises(InvalidDocument):
        parse(manifest_doc(step="3"))  # strict: no coercion from strings
    with pytest.raises(InvalidDocument):
        parse(with_entries(entry_doc(extra="x")))


# -- the manifest's own rules --------------------------------------------------------------


def test_a_good_entry_parses() -> None:
    m = parse(with_entries(entry_doc()))
    assert m.entries[0].numel == 12000
    assert len(m.entries[0].chunks) == 12
    assert m.nbytes == 48000


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"nbytes": 47999}, "nbytes"),
        ({"chunks": [CID] * 11}, "chunks for"),
        ({"chunks": [CID] * 13}, "chunks for"),
        ({"chunks": ["A" * 64] * 12}, "bad chunk id"),
        ({"chunks": ["0" * 63] * 12}, "bad chunk id"),
        ({"chunks": ["0" * 64 + "\n"] * 12}, "bad chunk id"),
        ({"dtype": "float24"}, "dtype"),
        ({"shape": [4, 3000, 1]}, "rank"),
        ({"offsets": [0]}, "rank"),
        ({"global_shape": [-4, 3000], "shape": [-4, 3000]}, "negative"),
        ({"placement": "sharded", "offsets": [1, 0]}, "outside"),
        ({"placement": "sharded", "offsets": [0, 1]}, "outside"),
        ({"placement": "replicated", "offsets": [1, 0], "global_shape": [5, 3000]}, "whole"),
        ({"placement": "replicated", "global_shape": [8, 3000]}, "whole"),
        ({"placement": "local", "global_shape": [8, 3000]}, "whole"),
        ({"placement": "mirrored"}, "placement"),
        ({"name": ""}, "name"),
        ({"name": "x" * 4097}, "name"),
        ({"nbytes": -1}, "nbytes"),
    ],
)
def test_bad_entries_are_refused(change: dict[str, Any], words: str) -> None:
    e = entry_doc(**change)
    with pytest.raises(InvalidDocument) as info:
        parse(with_entries(e))
    assert words in str(info.value)


def test_a_sharded_entry_inside_its_global_shape_is_fine() -> None:
    e = entry_doc(placement="sharded", global_shape=[8, 3000], offsets=[4, 0])
    parse(with_entries(e))


def test_duplicate_entry_names_are_refused() -> None:
    e = entry_doc()
    with pytest.raises(InvalidDocument, match="twice"):
        parse(with_entries(e, e, tree={"list": [{"tensor": "w"}]}))


def _row_shard(row: int, rows: int = 1, **changes: Any) -> dict[str, Any]:
    """Rows ``[row, row + rows)`` of a [4, 3000] float32 tensor, as a sharded entry."""
    n = rows * 3000 * 4
    return entry_doc(placement="sharded", offsets=[row, 0], shape=[rows, 3000], nbytes=n,
                     chunks=[CID] * math.ceil(n / 4096), **changes)


def test_several_shards_of_one_tensor_in_one_manifest_parse() -> None:
    # (1.3) A ShardedTensor with several local shards: rows 0 and 2..4 of one tensor,
    # named once in the tree.
    m = parse(with_entries(_row_shard(0), _row_shard(2, 2), tree=flat_tree(["w"])))
    assert [e.offsets for e in m.entries] == [[0, 0], [2, 0]]


@pytest.mark.parametrize(
    ("second", "words"),
    [
        (_row_shard(0, 2), "twice"),  # the same box again
        (_row_shard(1, 2), "overlap"),  # rows 1..2 and rows 0..1 share row 1
        (_row_shard(2, dtype="int32"), "differ in dtype"),
        (entry_doc(), "only sharded entries"),  # a whole (replicated) entry of the name
    ],
)
def test_repeated_names_that_cannot_be_one_tensor_are_refused(
    second: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidDocument, match=words):
        parse(with_entries(_row_shard(0, 2), second, tree=flat_tree(["w"])))


def test_one_manifest_holds_a_bounded_number_of_shards_of_one_tensor() -> None:
    from ckptd.format import MAX_LOCAL_SHARDS

    def shard(i: int) -> dict[str, Any]:
        e = entry_doc(placement="sharded", global_shape=[MAX_LOCAL_SHARDS + 1, 1],
                      offsets=[i, 0], shape=[1, 1], nbytes=4, chunks=[CID])
        return e

    parse(with_entries(*[shard(i) for i in range(MAX_LOCAL_SHARDS)], tree=flat_tree(["w"])))
    with pytest.raises(InvalidDocument, match="at most"):
        parse(with_entries(*[shard(i) for i in range(MAX_LOCAL_SHARDS + 1)],
                           tree=flat_tree(["w"])))


def test_tree_and_entries_must_name_the_same_tensors() -> None:
    a, b = entry_doc(name="a"), entry_doc(name="b")
    with pytest.raises(InvalidDocument, match="same tensors"):
        parse(with_entries(a, b, tree=flat_tree(["a"])))
    with pytest.raises(InvalidDocument, match="same tensors"):
        parse(with_entries(a, tree=flat_tree(["a", "b"])))
    with pytest.raises(InvalidDocument, match="twice"):
        parse(with_entries(a, tree={"list": [{"tensor": "a"}, {"tensor": "a"}]}))
    parse(with_entries(a, b, tree={"tuple": [{"tensor": "b"}, {"tensor": "a"}]}))


def test_manifest_header_rules() -> None:
    with pytest.raises(InvalidName):
        parse(manifest_doc(job="../x"))
    with pytest.raises(InvalidName):
        parse(manifest_doc(job="x" * 129))
    with pytest.raises(InvalidName):
        parse(manifest_doc(job=""))
    with pytest.raises(InvalidName):
        parse(manifest_doc(rank=2))  # world size 2
    with pytest.raises(InvalidDocument, match="world_size"):  # a field, not a name
        parse(manifest_doc(world_size=0))
    with pytest.raises(InvalidName):
        parse(manifest_doc(step=-1))
    with pytest.raises(InvalidDocument, match="chunk_size"):
        parse(manifest_doc(chunk_size=4095))
    with pytest.raises(InvalidDocument, match="chunk_size"):
        parse(manifest_doc(chunk_size=256 * 1024 * 1024 + 1))
    with pytest.raises(InvalidDocument):
        parse(manifest_doc(meta=[1]))
    # a bad job name is also an InvalidRequest of the same family as documents
    assert issubclass(InvalidName, ValueError)


def test_text_that_utf8_cannot_encode_is_refused() -> None:
    doc = manifest_doc()
    doc["tree"]["dict"].append(["\ud800", {"value": 1}])  # a lone surrogate
    with pytest.raises(InvalidDocument):
        RankManifest.parse(json.dumps(doc).encode())


def test_checks_hold_for_documents_built_in_code() -> None:
    m, _ = demo_step("job", 3, 2)[0]
    bad = replace(m, meta={"x": math.nan})
    with pytest.raises(InvalidDocument):
        bad.check()
    bad = replace(m, tree={"value": math.inf})
    with pytest.raises(InvalidDocument):
        bad.check()


# -- the tree ------------------------------------------------------------------------------


GOOD_TREE = {
    "dict": [
        ["model", {"dict": [["w", {"tensor": "w"}]]}],
        [0, {"list": [{"value": 1}, {"value": 2.5}, {"value": None}, {"value": "s"}]}],
        ["0", {"tuple": [{"float": "nan"}, {"float": "inf"}, {"float": "-inf"}]}],
        ["flag", {"value": True}],
        ["empty", {"dict": []}],
    ]
}


def test_every_tree_node_kind() -> None:
    names: set[str] = set()
    check_tree(GOOD_TREE, names)
    assert names == {"w"}


@pytest.mark.parametrize(
    "tree",
    [
        {"mystery": 1},
        {"value": 1, "list": []},
        {},
        [],
        "w",
        {"dict": {"a": {"value": 1}}},
        {"dict": [["a"]]},
        {"dict": [[True, {"value": 1}]]},
        {"dict": [[1.5, {"value": 1}]]},
        {"dict": [[None, {"value": 1}]]},
        {"dict": [["a", {"value": 1}], ["a", {"value": 2}]]},
        {"dict": [[1, {"value": 1}], [1, {"value": 2}]]},
        {"list": {"value": 1}},
        {"tensor": 5},
        {"float": "NaN"},
        {"float": 1.0},
        {"value": [1, 2]},
        {"value": {"a": 1}},
        {"value": math.nan},
    ],
)
def test_bad_trees_are_refused(tree: Any) -> None:
    with pytest.raises(InvalidDocument):
        check_tree(tree, set())


def test_int_and_string_keys_are_distinct() -> None:
    check_tree({"dict": [[1, {"value": 1}], ["1", {"value": 2}]]}, set())


def test_tree_depth_is_bounded() -> None:
    node: Any = {"value": 1}
    for _ in range(MAX_TREE_DEPTH):
        node = {"list": [node]}
    check_tree(node, set())
    with pytest.raises(InvalidDocument, match="deeper"):
        check_tree({"list": [node]}, set())


# -- the commit record ---------------------------------------------------------------------


def test_commit_record_names_one_manifest_per_rank_in_order() -> None:
    report = json.loads(
        ValidationReport(
            tensors=0, logical_bytes=0, chunks=0, replicated_entries=0, sharded_entries=0,
            local_entries=0,
        ).canonical()
    )

    def record(ranks: list[int], world: int) -> bytes:
        return json.dumps(
            {
                "format": "ckptd.commit", "version": 1, "job": "j", "step": 1,
                "world_size": world, "report": report, "committed_at": 1.0,
                "manifests": [{"rank": r, "hash": CID, "size": 1} for r in ranks],
            }
        ).encode()

    CommitRecord.parse(record([0, 1], 2))
    for ranks, world in (([1, 0], 2), ([0], 2), ([0, 1, 2], 2), ([0, 0], 2)):
        with pytest.raises(InvalidDocument):
            CommitRecord.parse(record(ranks, world))


# -- chunking ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    chunk_size=st.integers(1, 1 << 20), chunks=st.integers(0, 300), tail=st.integers(0, 1 << 20)
)
def test_chunk_spans_cover_exactly_at_fixed_offsets(
    chunk_size: int, chunks: int, tail: int
) -> None:
    nbytes = chunks * chunk_size + tail % chunk_size  # bounded span count, any remainder
    spans = list(chunk_spans(nbytes, chunk_size))
    assert len(spans) == chunk_count(nbytes, chunk_size)
    pos = 0
    for i, (start, end) in enumerate(spans):
        assert start == pos == i * chunk_size  # fixed offsets
        assert 0 < end - start <= chunk_size
        if i < len(spans) - 1:
            assert end - start == chunk_size  # only the last one is shorter
        pos = end
    assert pos == nbytes


def test_chunk_spans_refuse_a_bad_chunk_size() -> None:
    with pytest.raises(ValueError):
        list(chunk_spans(10, 0))


def test_an_unchanged_region_keeps_its_chunk_ids() -> None:
    data = bytearray(range(256)) * 64  # 16 KiB: four 4 KiB chunks
    before, _ = tensor_entry("t", "uint8", [len(data)], bytes(data))
    data[5000] ^= 1  # one byte in the second chunk
    after, _ = tensor_entry("t", "uint8", [len(data)], bytes(data))
    assert [a == b for a, b in zip(before.chunks, after.chunks, strict=True)] == [
        True, False, True, True
    ]


def test_chunk_id_is_lowercase_hex_blake3() -> None:
    assert chunk_id(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert chunk_id(b"abc") == blake3.blake3(b"abc").hexdigest()
    big = bytes(3 << 20)  # above the threshold where blake3 uses its own threads
    assert chunk_id(big) == blake3.blake3(big).hexdigest()
    assert chunk_id(memoryview(big)) == chunk_id(bytearray(big))


def test_dtype_table() -> None:
    assert dtypes.itemsize("bfloat16") == 2
    assert dtypes.itemsize("float8_e4m3fn") == 1
    assert dtypes.itemsize("complex128") == 16
    with pytest.raises(InvalidDocument):
        dtypes.itemsize("float24")


# -- round trips of random valid manifests -------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.floats(allow_nan=False,
    allow_infinity=False), st.text(max_size=10),
)


@st.composite
def manifests(draw: st.DrawFn) -> RankManifest:
    world = draw(st.integers(1, 4))
    rank = draw(st.integers(0, world - 1))
    entry_names = draw(st.lists(names, max_size=4, unique=True))
    entries = []
    for n in entry_names:
        dtype = draw(st.sampled_from(sorted(dtypes.ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 40), max_size=3))
        placement = draw(st.sampled_from(["replicated", "local"]))
        e, _ = tensor_entry(n, dtype, shape, placement=placement)
        entries.append(e)
    values = draw(st.dictionaries(st.text(max_size=5), json_scalars, max_size=4))
    tree = flat_tree(entry_names)
    tree["dict"].extend([[f"v:{k}", {"value": v}] for k, v in values.items()])
    return rank_manifest("job", draw(st.integers(0, 10**6)), rank, world, entries, tree=tree,
                         meta={"note": draw(st.text(max_size=10))})


@settings(max_examples=60, deadline=None)
@given(manifests())
def test_random_manifests_round_trip(m: RankManifest) -> None:
    data = m.canonical()
    again = RankManifest.parse(data)
    assert again == m
    assert again.canonical() == data
    assert again.digest() == m.digest()


def test_a_manifest_names_its_timeline_in_meta() -> None:
    m, _ = demo_step("j", 1, 1)[0]
    assert manifest_epoch(m) == 0  # saved before any rollback
    stamped = replace(m, meta={**m.meta, "epoch": 3})
    assert manifest_epoch(RankManifest.parse(stamped.canonical())) == 3
    for bad in (-1, "1", 1.0, True, None):
        with pytest.raises(InvalidDocument, match="epoch"):
            RankManifest.parse(replace(m, meta={"epoch": bad}).canonical())


def test_timeline_document() -> None:
    doc = Timeline(epoch=2, step=5, commit=chunk_id(b"c"))
    assert Timeline.parse(doc.canonical()) == doc
    assert json.loads(doc.canonical())["format"] == "ckptd.timeline"
    with pytest.raises(InvalidDocument):
        Timeline.parse(canonical_json({**json.loads(doc.canonical()), "epoch": 0}))
    with pytest.raises(InvalidDocument):
        Timeline.parse(Ref(step=5, commit=chunk_id(b"c")).canonical())
