"""A million tensor entries in the store (issue 20 item 6): saves and /healthz stay
within 2x of a server's over an empty store, measured side by side in the same
run, and GET /v1/space answers in under a second, all while the census counts
the store from scratch (the server just started) and after. The old census
recounted every manifest on the document thread: GET /v1/space took 37-50 s and
saves seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.format import RankManifest
from ckptd.testing.big_store import CHUNK_BYTES, big_chunks, manifest_bytes, tensor_name
from ckptd.testing.manifests import flat_tree
from tests.lifecycle.census_scale import measure


def test_the_big_stores_manifests_are_canonical() -> None:
    ids = sorted(big_chunks(3))
    data = manifest_bytes("moe-0", 2, 1, 2, 20, ids)
    parsed = RankManifest.parse(data)
    assert parsed.canonical() == data
    assert parsed.tree == flat_tree(tensor_name(i) for i in range(20))
    assert [e.chunks for e in parsed.entries][:4] == [[ids[0]], [ids[1]], [ids[2]], [ids[0]]]
    assert all(e.nbytes == CHUNK_BYTES for e in parsed.entries)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_million_entries_keep_saves_health_and_space_fast(tmp_path: Path, shm: Path) -> None:
    run = measure(tmp_path, shm)
    assert run.big.entries == 1_000_000
    empty, full = run.empty.row(), run.full.row()
    print(f"\ncensus of {run.big.entries} entries: {run.census_s:.1f} s; empty / full store:",
          {k: (round(empty[k], 4), round(full[k], 4)) for k in empty})
    assert full["space_worst"] < 1.0, full
    assert full["save_median"] <= 2 * empty["save_median"], (empty, full)
    assert full["save_p90"] <= 2 * empty["save_p90"], (empty, full)
    assert full["health_median"] <= 2 * empty["health_median"], (empty, full)
    assert full["health_p90"] <= 2 * empty["health_p90"], (empty, full)
    jobs = {j["job"]: j for j in run.final["jobs"]}
    assert run.final["complete"] and run.final["damaged"] == []
    assert {"moe-0", "moe-1", "saves"} <= set(jobs), run.final
    for i in range(2):
        assert jobs[f"moe-{i}"]["logical_bytes"] == 2 * run.big.step_logical_bytes
        assert jobs[f"moe-{i}"]["stored_bytes"] == len(run.big.chunks) * CHUNK_BYTES
    assert [s["step"] for s in jobs["saves"]["steps"]] == sorted(
        s["step"] for s in jobs["saves"]["steps"]) and len(jobs["saves"]["steps"]) >= 6
