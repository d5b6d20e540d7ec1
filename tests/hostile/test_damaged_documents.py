"""Damage to one document of a job degrades what needs it, with a 5xx
``store_corrupt`` naming it, never a 400 blaming the caller: tags, a rank manifest
of the newest step (a restore falls back a step, every rank alike), a commit record
(the store's space is still counted), a removal claim (taken over, not a step held
uncommitted forever)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.repository import Repository
from ckptd.store.local import LocalStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess

STEPS = {"tags": 2, "badman": 2, "badver": 2, "badrecord": 2, "claim": 3, "claimed": 2,
         "rot": 2, "gone": 2}


async def _fill(root: Path) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    for job, last in STEPS.items():
        for step in range(1, last + 1):
            for manifest, chunks in demo_step(job, step, 2, seed=job):
                await put_rank(repo, manifest, chunks)
            assert (await repo.commit(job, step)).state == "committed"


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("damaged-docs") / "store"
    asyncio.run(_fill(root))
    jobs = root / "jobs"
    (jobs / "tags" / "refs" / "tags").write_bytes(b'{"format":"ckptd.tags",')
    man = jobs / "badman" / "steps" / "2" / "ranks" / "1.json"
    man.write_bytes(man.read_bytes()[:100])
    man = jobs / "badver" / "steps" / "2" / "ranks" / "0.json"
    man.write_bytes(man.read_bytes().replace(b'"version":1', b'"version":7'))
    (jobs / "gone" / "steps" / "2" / "ranks" / "1.json").unlink()
    record = jobs / "badrecord" / "steps" / "2" / "commit.json"
    record.write_bytes(record.read_bytes()[:40])
    for job in ("claim", "claimed"):
        (jobs / job / "steps" / "1" / "removing.json").write_bytes(b"garbage")
    srv = ServerProcess(store=root)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(damaged: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=damaged.url, timeout=60.0) as c:
        yield c


def _corrupt(r: httpx.Response, key: str) -> None:
    assert r.status_code == 500, r.text
    assert r.json()["code"] == "store_corrupt" and r.json()["detail"]["key"] == key, r.text


def test_damaged_tags_are_store_damage_until_removed(damaged: ServerProcess,
                                                     api: httpx.Client) -> None:
    _corrupt(api.get("/v1/jobs/tags/tags"), "jobs/tags/refs/tags")
    # Retention cannot know what the tags keep: it stops, saying why.
    _corrupt(api.post("/v1/jobs/tags/forget", params={"dry_run": "true", "keep_last": 1}),
             "jobs/tags/refs/tags")
    # A tag write does not replace it (tests/integration/test_damaged_tags.py)...
    _corrupt(api.put("/v1/jobs/tags/tags/best", json={"step": 1}), "jobs/tags/refs/tags")
    # ...removing it, as the message says, does.
    (Path(damaged.store) / "jobs" / "tags" / "refs" / "tags").unlink()
    r = api.put("/v1/jobs/tags/tags/best", json={"step": 1})
    assert r.status_code == 200, r.text
    assert api.get("/v1/jobs/tags/tags").json() == {"best": 1}
    r = api.post("/v1/jobs/tags/forget", params={"dry_run": "true", "keep_last": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("job", ["badman", "badver", "gone"])
def test_a_damaged_manifest_of_latest_makes_every_rank_restore_the_step_before(
    api: httpx.Client, job: str
) -> None:
    for rank in (0, 1):  # the rank with the good manifest too: they restore one step
        r = api.get(f"/v1/jobs/{job}/restore-plan", params={"rank": rank})
        assert r.status_code == 200, r.text
        assert r.json()["step"] == 1
    r = api.get(f"/v1/jobs/{job}/step-plan", params={"rank": 0})
    assert r.status_code == 200, r.text
    assert r.json()["step"] == 1
    assert f"jobs/{job}/steps/2/ranks/" in " ".join(r.json()["fallback"])
    r = api.get(f"/v1/jobs/{job}/latest")
    assert r.status_code == 200 and r.json()["step"] == 1, r.text


@pytest.mark.parametrize(("job", "bad"), [("badman", 1), ("badver", 0), ("gone", 1)])
def test_a_damaged_manifest_of_a_committed_step_read_by_its_step_is_store_corrupt(
    api: httpx.Client, job: str, bad: int
) -> None:
    key = f"jobs/{job}/steps/2/ranks/{bad}.json"  # truncated, replaced or deleted
    _corrupt(api.get(f"/v1/jobs/{job}/steps/2/ranks/{bad}"), key)
    _corrupt(api.get(f"/v1/jobs/{job}/restore-plan", params={"rank": bad, "step": 2}), key)
    _corrupt(api.get(f"/v1/jobs/{job}/step-plan", params={"rank": 0, "step": 2}), key)
    r = api.get(f"/v1/jobs/{job}/steps/2/ranks/{1 - bad}")  # the intact rank still reads
    assert r.status_code == 200, r.text


def test_space_counts_around_a_damaged_commit_record(api: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while True:  # the census's first pass over the store (a loaded machine: seconds)
        r = api.get("/v1/space")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["complete"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert any("jobs/badrecord/steps/2/commit.json" in d for d in body["damaged"])
    jobs = {j["job"]: j for j in body["jobs"]}
    assert [s["step"] for s in jobs["badrecord"]["steps"]] == [1]
    assert [s["step"] for s in jobs["tags"]["steps"]] == [1, 2]


def test_retention_takes_over_an_unreadable_removal_claim(api: httpx.Client) -> None:
    r = api.post("/v1/jobs/claim/forget", params={"keep_last": 1})
    assert r.status_code == 200, r.text
    assert api.get("/v1/jobs/claim/steps/1").status_code == 404
    assert api.get("/v1/jobs/claim/steps/2").status_code == 404


def test_a_commit_retry_is_not_held_by_an_unreadable_removal_claim(api: httpx.Client) -> None:
    t0 = time.monotonic()
    r = api.post("/v1/jobs/claimed/steps/1/commit", json={})
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    assert time.monotonic() - t0 < 10  # not the 30 s wait for a live removal


def test_a_manifest_damaged_after_latest_was_checked_falls_back_at_its_first_read(
    damaged: ServerProcess, api: httpx.Client
) -> None:
    r = api.get("/v1/jobs/rot/restore-plan", params={"rank": 0})
    assert r.status_code == 200 and r.json()["step"] == 2, r.text  # checked intact, kept
    man = Path(damaged.store) / "jobs" / "rot" / "steps" / "2" / "ranks" / "1.json"
    man.write_bytes(man.read_bytes()[:100])
    for rank in (1, 0):  # the rank that meets the damage, then every other rank
        r = api.get("/v1/jobs/rot/restore-plan", params={"rank": rank})
        assert r.status_code == 200 and r.json()["step"] == 1, r.text
