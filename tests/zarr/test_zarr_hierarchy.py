"""The zarr view's hierarchy from manifests alone: names, groups, attributes, dtypes."""

from __future__ import annotations

from ckptd.testing.manifests import rank_manifest, tensor_entry
from ckptd.zarr.hierarchy import build, node_name


def test_reserved_and_unsafe_keys_become_distinct_node_names() -> None:
    keys = ["", ".", "..", "zarr.json", "a/b", "50%", "__x", "c", "layers.0.w", "%2E"]
    names = [node_name(k) for k in keys]
    assert names[:7] == ["%", "%2E", "%2E%2E", "zarr%2Ejson", "a%2Fb", "50%25", "%5F_x"]
    assert names[7:9] == ["c", "layers.0.w"]
    assert len(set(names)) == len(names)
    assert all("/" not in n and not n.startswith("__") for n in names)


def test_tree_shapes_become_groups_arrays_and_attributes() -> None:
    bf, _ = tensor_entry("m.w", "bfloat16", [4, 8])
    f8, _ = tensor_entry("m.q", "float8_e4m3fn", [16])
    loc, _ = tensor_entry("rng", "int64", [2], placement="local")
    tree = {"dict": [
        ["m", {"dict": [["w", {"tensor": "m.w"}], ["q", {"tensor": "m.q"}]]}],
        ["groups", {"list": [{"dict": [["lr", {"value": 0.1}], ["best", {"float": "-inf"}]]}]}],
        [1, {"value": "int key"}], ["1", {"dict": [["r", {"tensor": "rng"}]]}],
    ]}
    h = build([rank_manifest("j", 3, 0, 1, [bf, f8, loc], tree=tree)])
    assert set(h.arrays) == {"m/w", "m/q", "1/r"}
    meta = h.metadata("m/w")
    assert meta is not None and meta["data_type"] == "uint16" and meta["shape"] == [4, 8]
    assert meta["attributes"]["ckptd"]["dtype"] == "bfloat16"
    q = h.metadata("m/q")
    assert q is not None and q["data_type"] == "uint8" and "configuration" not in q["codecs"][0]
    assert h.groups["groups"].attributes["ckptd"] == {"kind": "list"}
    assert h.groups["groups/0"].attributes == {"lr": 0.1, "best": "-Infinity"}
    assert h.groups[""].attributes["1"] == "int key"
    root = h.groups[""].attributes["ckptd"]
    assert root["tree"] == tree and root["arrays"]["rng"] == "1/r" and root["step"] == 3
    keys = set(h.store_keys())
    assert {"zarr.json", "m/zarr.json", "m/w/zarr.json", "m/w/c/0/0", "1/r/c/0"} <= keys


def test_shards_assemble_and_replicas_appear_once() -> None:
    halves = [tensor_entry("w", "float32", [4, 1024], placement="sharded", global_shape=[8, 1024],
                           offsets=[4 * r, 0], seed=f"w{r}")[0] for r in range(2)]
    bias = tensor_entry("b", "float32", [3])[0]
    ms = [rank_manifest("j", 1, r, 4, [halves[r % 2], bias]) for r in range(4)]
    h = build(ms)
    grid = h.arrays["w"].grid
    assert grid.shape == (8, 1024) and grid.aligned and grid.chunk_shape == (1, 1024)
    assert [b.offsets for b in grid.boxes] == [(0, 0), (4, 0)]
    assert len(h.arrays["b"].grid.boxes) == 1
