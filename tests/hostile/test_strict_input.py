"""Loose input (item 10), unbounded shapes (item 9) and deep JSON (item 5) against
a real server: every one is a 400 with a stable code, never a 500 or a surprise."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from ckptd.errors import InvalidDocument
from ckptd.format import MIN_CHUNK_SIZE, RankManifest


@pytest.mark.parametrize(
    "body",
    [
        {"world_size": True},
        {"world_size": "1"},
        {"world_size": 1.0},
        {"world_size": 1, "step": 484.0},
        {"world_size": 1, "held_step": "3"},
        {"world_size": 1, "step": True},
    ],
)
def test_heartbeat_refuses_loose_types(client: httpx.Client, body: dict[str, Any]) -> None:
    r = client.post("/v1/jobs/j/ranks/0/heartbeat", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_request"


@pytest.mark.parametrize("rank", [False, "0", 0.0])
def test_snapshot_request_refuses_loose_rank(client: httpx.Client, rank: Any) -> None:
    r = client.post("/v1/jobs/j/snapshot-requests", json={"rank": rank, "reason": "x"})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("step", ["01", "+1", "1_000", " 1", "1e3"])
def test_step_in_the_path_is_one_spelling(client: httpx.Client, step: str) -> None:
    r = client.get(f"/v1/jobs/j/steps/{step}")
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_name"


def test_rank_in_the_path_is_one_spelling(client: httpx.Client) -> None:
    r = client.post("/v1/jobs/j/ranks/01/heartbeat", json={"world_size": 4})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_name"


def test_query_step_is_one_spelling(client: httpx.Client) -> None:
    r = client.get("/v1/jobs/j/restore-plan", params={"rank": "0", "step": "007"})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_name"  # a step is named as in the path


@pytest.mark.parametrize("path, params", [
    ("/v1/gc", {"grace": "-1"}), ("/v1/scrub", {"budget_bytes": "-1"}),
    ("/v1/jobs/j/forget", {"keep_last": "0"}), ("/v1/gc", {"dry_run": "maybe"}),
])
def test_a_query_value_out_of_range_is_an_invalid_request_not_a_name(
    client: httpx.Client, path: str, params: dict[str, str]
) -> None:
    """(found by a helper: a negative budget_bytes was answered ``invalid_name``, the
    code of a bad name in the URL, as was every bad query parameter)"""
    r = client.post(path, params=params)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_request", r.text
    assert next(iter(params)) in r.json()["message"], r.text


def test_openapi_names_the_patterns(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    params = {
        p["name"]: p["schema"]
        for path in doc["paths"].values()
        for op in path.values()
        for p in op.get("parameters", [])
        if p["in"] == "path"
    }
    for name in ("job", "step", "rank", "id"):
        assert "pattern" in params[name], (name, params[name])
    # A schema-driven client that follows the pattern never gets a 400 for the name.
    assert re.fullmatch(params["step"]["pattern"].strip("^$"), "0")
    assert not re.fullmatch(params["step"]["pattern"].strip("^$"), "01")


# -- item 9: shapes, offsets and counts are bounded at PUT time ------------------------


def _manifest_doc(shape: list[Any], nbytes: int = 0, chunks: int = 0) -> dict[str, Any]:
    return {
        "format": "ckptd.rank_manifest",
        "version": 1,
        "job": "j",
        "step": 1,
        "rank": 0,
        "world_size": 1,
        "chunk_size": MIN_CHUNK_SIZE,
        "entries": [
            {
                "name": "w",
                "dtype": "float32",
                "placement": "replicated",
                "global_shape": shape,
                "offsets": [0] * len(shape),
                "shape": shape,
                "nbytes": nbytes,
                "chunks": ["0" * 64] * chunks,
            }
        ],
        "tree": {"dict": [["w", {"tensor": "w"}]]},
        "meta": {},
    }


@pytest.mark.parametrize(
    "shape",
    [
        [0, 10**4000],
        [0, 2**63],
        [2**40, 2**40, 0],
        [1] * 65,
    ],
)
def test_unrestorable_shapes_are_refused_at_put(client: httpx.Client, shape: list[int]) -> None:
    data = json.dumps(_manifest_doc(shape)).encode()
    r = client.put("/v1/jobs/j/steps/1/ranks/0", content=data)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_document"


def test_shape_bounds_in_the_format() -> None:
    with pytest.raises(InvalidDocument):
        RankManifest.parse(json.dumps(_manifest_doc([0, 10**4000])).encode())


# -- item 5: nesting -------------------------------------------------------------------


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deep_json_manifest_is_a_400(client: httpx.Client, depth: int) -> None:
    r = client.put("/v1/jobs/j/steps/1/ranks/0", content=b"[" * depth + b"]" * depth)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_document"
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deep_json_body_is_a_400(client: httpx.Client, depth: int) -> None:
    body = b'{"world_size": 1, "health": {"signals": ' + b"[" * depth + b"]" * depth + b"}}"
    r = client.post(
        "/v1/jobs/j/ranks/0/heartbeat", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_request"
    assert client.get("/healthz").status_code == 200


def test_deep_json_in_meta_is_a_400(client: httpx.Client) -> None:
    body = b'{"meta": {"a": ' + b"[" * 3000 + b"]" * 3000 + b"}}"
    r = client.post(
        "/v1/jobs/j/steps/1/commit", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("world_size", [-1, 0, 2**20 + 1])
def test_a_bad_world_size_is_a_malformed_document(client: httpx.Client, world_size: int) -> None:
    """(found by a probe: ``world_size: -1`` was answered ``invalid_name``, the code of
    a bad name in the URL; a world size is a field of the document)"""
    data = json.dumps({**_manifest_doc([0]), "world_size": world_size}).encode()
    r = client.put("/v1/jobs/j/steps/1/ranks/0", content=data)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_document", r.text
    assert "world_size" in r.json()["message"] and "\n" not in r.json()["message"]


# -- media types: JSON is application/json ----------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/jsonx", None])
def test_a_json_body_sent_as_another_type_is_415(client: httpx.Client,
                                                 content_type: str | None) -> None:
    """(found by a probe: JSON sent as text/plain was told "Input should be a valid
    dictionary"; every client of ours sends application/json)"""
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post("/v1/jobs/j/ranks/0/heartbeat", content=b'{"world_size": 1}',
                    headers=headers)
    assert r.status_code == 415, r.text
    body = r.json()
    assert body["code"] == "unsupported_media_type"
    assert "application/json" in body["message"] and "\n" not in body["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8",
                                          "Application/JSON", "application/merge-patch+json"])
def test_json_media_types_are_json(client: httpx.Client, content_type: str) -> None:
    r = client.post("/v1/jobs/j/ranks/0/heartbeat", content=b'{"world_size": 1}',
                    headers={"content-type": content_type})
    assert r.status_code == 200, r.text


def test_a_manifest_sent_as_another_type_is_415(client: httpx.Client) -> None:
    data = json.dumps({**_manifest_doc([0]), "step": 7}).encode()
    r = client.put("/v1/jobs/j/steps/7/ranks/0", content=data,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    assert r.json()["code"] == "unsupported_media_type"
    # (a manifest with no type at all is read as JSON, as it always was)
    assert client.put("/v1/jobs/j/steps/7/ranks/0", content=data).status_code == 201


# -- JSON has no NaN ---------------------------------------------------------------------


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_a_json_body_are_refused(client: httpx.Client, token: str) -> None:
    """(found by a probe: Python's parser, under FastAPI's, read them; a heartbeat
    signal of NaN was kept as "nan". Documents refuse them already: ckptd.large_json)"""
    body = '{"world_size": 1, "health": {"signals": {"loss": TOKEN}}}'.replace("TOKEN", token)
    r = client.post("/v1/jobs/j/ranks/0/heartbeat", content=body,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_request"
    assert token.lstrip("-") in r.json()["message"] and "\n" not in r.json()["message"]
    r = client.post("/v1/jobs/j/steps/1/commit", content='{"meta": {"x": ' + token + "}}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text


def test_nan_in_a_json_string_is_text(client: httpx.Client) -> None:
    body = {"world_size": 1, "health": {"state": "critical", "reasons": ["loss is NaN"],
                                        "signals": {"loss": "nan", "Infinity": 1}}}
    assert client.post("/v1/jobs/j/ranks/0/heartbeat", json=body).status_code == 200


def test_nan_nested_past_the_parsers_depth_is_a_400(client: httpx.Client) -> None:
    """(found by review: the NaN check parsed the body before the depth check ran,
    and Python's parser raised RecursionError: a 500 and a traceback per request)"""
    body = "[" * 5000 + "NaN" + "]" * 5000
    r = client.post("/v1/chunks/read", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text
    assert "deeper" in r.json()["message"]
