"""Large manifests do not stall the server (item 2), bounded: 20,000 tensors (a
fifth of the benchmark's 100,000, see bench/commit_scale.py) put, committed and
planned while /healthz is polled. The bounds are loose for a busy CI machine; the
benchmark holds the real targets (/healthz < 200 ms, commit of 100,000 < 2 s)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from ckptd.hashing import chunk_id
from ckptd.testing.manifests import many_tensor_manifests
from tests.conftest import ServerProcess

TENSORS = 20_000


def _worst_health(url: str, work: Callable[[], None]) -> float:
    """Runs ``work`` while polling /healthz every 10 ms; the worst latency, seconds."""
    worst = 0.0
    stop = threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get(f"{url}/healthz").status_code == 200
                worst = max(worst, time.perf_counter() - t0)
                stop.wait(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        work()
    finally:
        stop.set()
        poller.join(60)
    return worst


@pytest.mark.slow
def test_a_large_manifest_keeps_health_answering(shared_server: ServerProcess) -> None:
    (manifest,), data = many_tensor_manifests("moe", 1, 1, TENSORS)
    body = manifest.canonical()
    with httpx.Client(base_url=shared_server.url, timeout=120) as c:
        assert c.put(f"/v1/chunks/{chunk_id(data)}", content=data).status_code in (200, 201)
        put = _worst_health(shared_server.url, lambda: c.put(
            "/v1/jobs/moe/steps/1/ranks/0", content=body).raise_for_status())
        took: list[float] = []

        def commit() -> None:
            t0 = time.perf_counter()
            r = c.post("/v1/jobs/moe/steps/1/commit")
            took.append(time.perf_counter() - t0)
            assert r.json()["state"] == "committed", r.text

        during_commit = _worst_health(shared_server.url, commit)
        plan = _worst_health(shared_server.url, lambda: c.get(
            "/v1/jobs/moe/restore-plan", params={"rank": "0"}).raise_for_status())
    # Before: on an idle machine the commit took about 1.5 s and /healthz stalled
    # for as long; on this shared 2-core machine (load 12-24) 12 s and 11 s.
    seen = {"commit_s": took[0], "health_put_s": put, "health_commit_s": during_commit,
            "health_plan_s": plan}
    assert took[0] < 6.0, seen
    assert during_commit < 1.0, seen
    assert plan < 1.0, seen
    assert put < 3.0, seen


def test_sliced_encoding_is_the_canonical_one() -> None:
    from ckptd.format import PARSE_SLICE, RankManifest, canonical_json

    (manifest,), _ = many_tensor_manifests("moe", 1, 1, PARSE_SLICE * 2 + 7)
    odd = RankManifest.model_validate(
        {**manifest.model_dump(), "meta": {"tree": "\x00ckptd-splice\x00", "entries": None}}
    )
    for m in (manifest, odd):
        data = m.canonical()
        assert data == canonical_json(m.model_dump(mode="json"))
        again = RankManifest.parse(data)
        assert again == m and again.canonical() == data


@pytest.mark.parametrize("text", [
    '{"a": [1, 2 , {"b": [3]}], "c" : {"d": {"e": 1}} , "f": [], "a": 2}', " [ ] ", "{}",
    '[1,[2,[3,[4]]]]', '{"a":"\\u00e9\\"]"}  ',
])
def test_piecewise_decoding_is_json_loads(text: str) -> None:
    import json

    from ckptd.large_json import decode_piecewise

    assert decode_piecewise(text) == json.loads(text)


@pytest.mark.parametrize("text", ['{"a":1,}', "[1 2]", '{"a" 1}', "[1,]", '{"a":NaN}',
                                  "[1] x", "{1:2}", "[", '{"a":'])
def test_piecewise_decoding_refuses_what_json_refuses(text: str) -> None:
    from ckptd.large_json import decode_piecewise

    with pytest.raises(ValueError):
        decode_piecewise(text)
