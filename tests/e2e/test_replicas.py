"""Dedup across data-parallel replicas: four gloo ranks with identical state save
one step; each chunk is sent once and stored once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

CHUNK = 16384
WORLD = 4


def stored_chunks(store: Path) -> dict[str, int]:
    """Chunk id -> size of every chunk file in a local store."""
    return {p.name: p.stat().st_size for p in (store / "chunks").glob("*/*")}


def check_common(results: list[dict[str, Any]], store: Path, job: str) -> dict[str, int]:
    distinct = results[0]["distinct_chunks"]
    assert all(r["distinct_chunks"] == distinct for r in results)  # identical replicas
    for r in results:
        assert r["latest"] == 1 and r["restored_step"] == 1
        assert r["restored_bitwise"] and r["restored_values"]
    assert sorted(r["state"] for r in results).count("committed") >= 1
    # The store holds every chunk once, named by its hash, and nothing half-written.
    assert stored_chunks(store) == distinct
    assert not [p for p in store.rglob(".tmp-*")]
    commit = json.loads((store / f"jobs/{job}/steps/1/commit.json").read_text())
    report = commit["report"]
    tensors = len(json.loads((store / f"jobs/{job}/steps/1/ranks/0.json").read_text())["entries"])
    assert report["replicated_entries"] == WORLD * tensors
    assert report["chunks"] == len(distinct)
    return distinct


def test_four_replicas_send_each_chunk_once_through_a_server(
    server: Any, torchrun: Any, tmp_path: Path
) -> None:
    results = torchrun("replicas.py", WORLD, server.url, "rep", "1", str(CHUNK),
                       out=tmp_path / "out")
    distinct = check_common(results, server.store, "rep")
    one_replica = sum(distinct.values())
    # The missing-chunks call leases what it returns to one caller; the others wait
    # for those ids instead of sending them: the ranks together send one replica.
    assert sum(r["bytes_sent"] for r in results) == one_replica
    assert sum(r["chunks_sent"] for r in results) == len(distinct)
    assert all(r["bytes_staged"] == results[0]["bytes_staged"] for r in results)


def test_four_replicas_store_each_chunk_once_through_a_local_store(
    torchrun: Any, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    results = torchrun("replicas.py", WORLD, f"file://{store}", "rep", "1", str(CHUNK),
                       out=tmp_path / "out")
    distinct = check_common(results, store, "rep")
    # Claims are soft state of one repository; over file:// every rank runs its own,
    # so replicas may each send a chunk: stored once all the same.
    sent = sum(r["bytes_sent"] for r in results)
    assert sum(distinct.values()) <= sent <= WORLD * sum(distinct.values())
