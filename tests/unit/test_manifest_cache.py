"""The memory of the parsed-manifest cache (``ckptd.documents.ParsedManifests``):
bounded by an estimate of what its manifests hold. Capped by entries and
manifests alone, 1024 manifests of a few entries of many chunks each held
hundreds of GiB (a 64 MiB manifest of such entries costs about 180 MiB parsed)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from ckptd.documents import (
    MANIFEST_CACHE_ENTRIES,
    MANIFEST_CACHE_MANIFESTS,
    ParsedManifests,
    manifest_cost,
)
from ckptd.format import RankManifest, canonical_json, manifest_key
from ckptd.hashing import chunk_id
from ckptd.knobs import MIN_CHUNK_SIZE
from ckptd.testing.manifests import flat_tree

IDS = [chunk_id(i.to_bytes(4, "big")) for i in range(4096)]


def manifest_body(step: int, tensors: int, chunks: int) -> bytes:
    """Canonical bytes of a manifest of ``tensors`` float32 tensors of ``chunks``
    chunks each (ids only: nothing here reads a chunk)."""
    nbytes = chunks * MIN_CHUNK_SIZE
    names = [f"layers.{i // 8}.p{i % 8}" for i in range(tensors)]
    entries = [{"chunks": [IDS[(i * chunks + k) % len(IDS)] for k in range(chunks)],
                "dtype": "float32", "global_shape": [nbytes // 4], "name": name,
                "nbytes": nbytes, "offsets": [0], "placement": "replicated",
                "shape": [nbytes // 4]} for i, name in enumerate(names)]
    return canonical_json({"chunk_size": MIN_CHUNK_SIZE, "entries": entries,
                           "format": "ckptd.rank_manifest", "job": "j", "meta": {}, "rank": 0,
                           "step": step, "tree": flat_tree(names), "version": 1,
                           "world_size": 1})


BOUND = 24 << 20
STEPS = 12


def measure() -> tuple[int, int]:
    """Reads STEPS manifests through a cache of BOUND bytes: (the memory it holds,
    measured with tracemalloc; its estimate). Run in a process of its own: in a
    test worker, threads left by earlier tests allocate meanwhile, and tracemalloc
    counts every thread (a full run measured 2.2 MB more than the cache held)."""
    cache = ParsedManifests(MANIFEST_CACHE_ENTRIES, max_bytes=BOUND)

    async def read_all() -> None:
        for step in range(STEPS):
            body = manifest_body(step, 16, 2048)
            await cache.parse(manifest_key("j", step, 0), body)
            del body  # (the caller's copy goes: what stays is the cache's)

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(read_all())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    newest = manifest_body(STEPS - 1, 16, 2048)
    assert cache.get(manifest_key("j", STEPS - 1, 0), newest) is not None
    assert cache.get(manifest_key("j", 0, 0), manifest_body(0, 16, 2048)) is None
    return held, cache._bytes


def test_the_cache_holds_no_more_memory_than_its_bound() -> None:
    """Manifests of 16 tensors of 2,048 chunks (2.2 MiB of JSON, 6 MiB parsed),
    read as a commit reads them (no digest: the parsed manifest encodes itself,
    and that copy is the one kept). What the cache holds stays under its
    estimate, and that under the bound."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", "import json; from tests.unit.test_manifest_cache import "
         "measure; print(json.dumps(measure()))"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    held, estimate = json.loads(done.stdout.strip().splitlines()[-1])
    assert held <= estimate <= BOUND, (held, estimate, BOUND)
    assert held > BOUND // 2, held  # (it keeps what fits)


def test_the_newest_manifest_stays_whatever_it_costs() -> None:
    cache = ParsedManifests(MANIFEST_CACHE_ENTRIES, max_bytes=64 * 1024)
    for step in range(3):
        body = manifest_body(step, 4, 256)
        cache.put(manifest_key("j", step, 0), body, RankManifest.parse(body))
        assert cache._bytes > 64 * 1024
    assert list(cache._held) == [manifest_key("j", 2, 0)]


def test_the_default_bound_keeps_two_steps_of_500_ranks_of_400_tensors() -> None:
    """The hit pattern the caps are sized for: a step's manifests put, then read
    again by its commit and its restore plans, while the next step's are put."""
    cache = ParsedManifests(MANIFEST_CACHE_ENTRIES)
    body = manifest_body(1, 400, 1)
    manifest = RankManifest.parse(body)
    assert manifest_cost(body, manifest) > 900 * 1024  # (about 1 MiB each)
    for rank in range(MANIFEST_CACHE_MANIFESTS):
        cache.put(manifest_key("j", 1, rank), body, manifest)
    assert len(cache._held) == MANIFEST_CACHE_MANIFESTS


def test_a_server_takes_its_bound_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from ckptd.server.app import create_app
    from ckptd.server.settings import Settings

    monkeypatch.setenv("CKPTD_MANIFEST_CACHE_BYTES", str(256 << 20))
    app = create_app(Settings(store="memory://"))
    with TestClient(app):
        assert app.state.repository._manifests.max_bytes == 256 << 20
