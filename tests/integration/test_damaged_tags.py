"""A damaged tags document (``jobs/<job>/refs/tags``: cut short, not JSON, of the
wrong shape) is store damage: ``store_corrupt`` naming it on read and on write alike,
with the way out in the message. A tag set or removed never replaces it (the tags it
held would be lost without a word), nothing blames the caller with a 400, and the
rest of the job goes on: saves, restores, ``ckptd ls``."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.repository import Repository
from ckptd.store.local import LocalStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess
from tests.integration.test_cli_mistakes import ckptd

# How a tags document is found damaged (a wrong shape that still parses as tags:
# a step no checkpoint can have, a name no tag can have: read, they were a 400
# blaming whoever asked for the tag).
DAMAGE = {
    "cut": b'{"format":"ckptd.tags","tags":{"best":1',
    "text": b"tags: best=1\n",
    "list": b"[1,2]",
    "step": b'{"format":"ckptd.tags","tags":{"best":-1},"version":1}',
    "name": b'{"format":"ckptd.tags","tags":{"a/b":1},"version":1}',
}


def _tags(root: Path, job: str) -> Path:
    return root / "jobs" / job / "refs" / "tags"


async def _fill(root: Path) -> None:
    repo = Repository(LocalStore(root, fsync=False))
    for job in DAMAGE:
        for step in (1, 2):
            for manifest, chunks in demo_step(job, step, 1, seed=job):
                await put_rank(repo, manifest, chunks)
            assert (await repo.commit(job, step)).state == "committed"


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("damaged-tags") / "store"
    asyncio.run(_fill(root))
    for job, data in DAMAGE.items():
        _tags(root, job).write_bytes(data)
    srv = ServerProcess(store=root)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _short_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    """A command stopped by the damaged document: said in one or two lines, exit 1
    (damage found, docs/operations.md), never a traceback."""
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in said, said
    assert 1 <= len([line for line in done.stderr.splitlines() if line.strip()]) <= 2, said
    for needle in needles:
        assert needle in said, said


def _store_corrupt(r: httpx.Response, job: str, path: Path) -> None:
    assert r.status_code == 500, r.text
    body = r.json()
    assert body["code"] == "store_corrupt", r.text
    assert body["detail"]["key"] == f"jobs/{job}/refs/tags", r.text
    # the way out: the file to fix or remove, and how to tag again
    assert str(path) in body["message"] and "remove" in body["message"], r.text
    assert f"ckptd tag {job} STEP NAME" in body["message"], r.text


@pytest.mark.parametrize("job", list(DAMAGE))
def test_a_damaged_tags_document_is_store_corrupt_on_read_and_write_and_stays(
    damaged: ServerProcess, job: str
) -> None:
    path = _tags(Path(damaged.store), job)
    with httpx.Client(base_url=damaged.url, timeout=60.0) as api:
        _store_corrupt(api.get(f"/v1/jobs/{job}/tags"), job, path)
        _store_corrupt(api.put(f"/v1/jobs/{job}/tags/other", json={"step": 2}), job, path)
        _store_corrupt(api.delete(f"/v1/jobs/{job}/tags/best"), job, path)
        assert path.read_bytes() == DAMAGE[job]  # not replaced: the evidence stays
        # The rest of the job works: its steps, latest and a restore plan.
        r = api.get(f"/v1/jobs/{job}/steps")
        assert r.status_code == 200 and len(r.json()["steps"]) == 2, r.text
        r = api.get(f"/v1/jobs/{job}/latest")
        assert r.status_code == 200 and r.json()["step"] == 2, r.text
        r = api.get(f"/v1/jobs/{job}/restore-plan", params={"rank": 0})
        assert r.status_code == 200, r.text


def test_the_cli_says_the_way_out_and_saves_restores_and_ls_go_on(
    server: ServerProcess, shm: Path
) -> None:
    root = Path(server.store)
    path = _tags(root, "llm")
    with Checkpointer(server.url, job="llm", shm_dir=str(shm)) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, {"w": torch.full((4,), float(step))}).wait(60).state == (
                "committed")
    done = ckptd("tag", "llm", "1", "best", "--url", server.url)
    assert done.returncode == 0, done.stdout + done.stderr
    data = path.read_bytes()[:-5]  # cut short: "best" is lost, and "other" must not be
    path.write_bytes(data)          # the only tag without a word
    for command in (["tag", "llm", "2", "other"], ["untag", "llm", "best"]):
        for url in (server.url, f"file://{root}"):
            done = ckptd(*command, "--url", url)
            _short_error(done, "store_corrupt", "jobs/llm/refs/tags", str(path),
                         "ckptd tag llm STEP NAME")
            assert path.read_bytes() == data, (command, url)
    done = ckptd("ls", "llm", "--url", server.url)  # (the steps, and the damage named)
    assert done.returncode == 1 and "latest" in done.stdout, done.stdout + done.stderr
    assert "damaged" in done.stderr and "llm tags" in done.stderr, done.stderr
    with Checkpointer(server.url, job="llm", shm_dir=str(shm)) as ckpt:
        # A save's tag cannot be set either: the step commits all the same.
        assert ckpt.save(3, {"w": torch.full((4,), 3.0)}, tag="t3").wait(60).state == (
            "committed")
        state = {"w": torch.zeros(4)}
        assert ckpt.restore(state).step == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
    assert path.read_bytes() == data
    path.unlink()  # the way out the message gave
    done = ckptd("tag", "llm", "1", "best", "--url", server.url)
    assert done.returncode == 0, done.stdout + done.stderr
    with httpx.Client(base_url=server.url, timeout=60.0) as api:
        assert api.get("/v1/jobs/llm/tags").json() == {"best": 1}
