"""``ckptd space`` through a real ``ckptd serve`` counts every chunk in the store, the
chunks of steps that retention or ``ckptd forget`` forgot since the server last
listed ``chunks/`` included, as ``ckptd space`` on the store does; and it shows the
chunks no committed step names (what a collection would delete)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank
from tests.conftest import ServerProcess
from tests.integration.test_lifecycle_server import _space_when_complete

JOB = "job"
runner = CliRunner()


def _upload(root: Path, step: int) -> None:
    async def put() -> None:
        repo = Repository(LocalStore(root, fsync=False))
        for manifest, chunks in demo_step(JOB, step, 2):
            await put_rank(repo, manifest, chunks)

    asyncio.run(put())


def _commit(srv: ServerProcess, root: Path, step: int) -> None:
    _upload(root, step)
    r = httpx.post(f"{srv.url}/v1/jobs/{JOB}/steps/{step}/commit", json={}, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def _steps(srv: ServerProcess) -> list[int]:
    r = httpx.get(f"{srv.url}/v1/jobs/{JOB}/steps", timeout=10)
    return [s["step"] for s in r.json()["steps"]] if r.status_code == 200 else []


def _on_disk(root: Path) -> tuple[int, int]:
    files = [p for p in (root / "chunks").rglob("*") if p.is_file()
             and not p.name.startswith(".")]
    return len(files), sum(p.stat().st_size for p in files)


def _cli(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _chunk_lines(out: str) -> list[str]:
    """The lines of ``ckptd space`` about chunks (not the space left, which moves)."""
    return [re.sub(r"; space left.*", "", line) for line in out.splitlines()
            if line.startswith(("chunks in store", "named by no committed step"))]


def _same_as_the_store(srv: ServerProcess, root: Path) -> dict[str, Any]:
    space = _space_when_complete(srv)
    chunks, nbytes = _on_disk(root)
    assert space["complete"], space
    assert (space["chunks"], space["chunk_bytes"]) == (chunks, nbytes), (space, chunks, nbytes)
    through = _cli("space", "--url", srv.url)
    direct = _cli("space", "--url", str(root))
    assert _chunk_lines(through) == _chunk_lines(direct), (through, direct)
    assert len(_chunk_lines(through)) == 2, through
    return space


def test_chunks_of_steps_retention_forgot_are_still_counted(tmp_path: Path) -> None:
    """(Through the server ``ckptd space`` said 53 chunks, complete, where the store
    held 68: the chunks of steps retention forgot since its last listing of chunks/
    dropped out of the count, exactly the garbage an operator sizes for.)"""
    root = tmp_path / "store"
    policy = tmp_path / "retention.toml"
    policy.write_text("[retention]\nkeep_last = 2\n")
    srv = ServerProcess(store=root, extra_args=["--retention", str(policy)])
    srv.start()
    try:
        assert _space_when_complete(srv)["chunks"] == 0  # chunks/ listed: empty
        for step in range(1, 6):
            _commit(srv, root, step)
            # (each step counted before the next commit's retention forgets one)
            assert _space_when_complete(srv)["complete"]
        deadline = time.monotonic() + 20
        while _steps(srv) != [4, 5] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _steps(srv) == [4, 5]
        space = _same_as_the_store(srv, root)
        assert [s["step"] for s in space["jobs"][0]["steps"]] == [4, 5], space
        # Three steps' chunks are in the store and named by no committed step.
        assert space["unreferenced_chunks"] > 0, space
        assert space["unreferenced_chunks"] == space["chunks"] - space["referenced_chunks"]
        dry = httpx.post(f"{srv.url}/v1/gc", params={"dry_run": True}, timeout=30).json()
        assert dry["chunks_deleted"] == space["unreferenced_chunks"], (dry, space)
        assert dry["bytes_freed"] == space["unreferenced_bytes"], (dry, space)
    finally:
        srv.stop()


def test_chunks_of_steps_ckptd_forget_forgot_are_still_counted(tmp_path: Path) -> None:
    """``ckptd forget`` through the server right after commits: the forgotten steps'
    chunks stay in the count (as named by no committed step) until a collection.
    (A step forgotten before the census counted it: tests/lifecycle/test_census.py.)"""
    root = tmp_path / "store"
    srv = ServerProcess(store=root)
    srv.start()
    try:
        assert _space_when_complete(srv)["chunks"] == 0
        for step in range(1, 5):
            _commit(srv, root, step)
        _cli("forget", JOB, "--keep-last", "1", "--url", srv.url)
        assert _steps(srv) == [4]
        space = _same_as_the_store(srv, root)
        assert [s["step"] for s in space["jobs"][0]["steps"]] == [4], space
        assert space["unreferenced_chunks"] == space["chunks"] - space["referenced_chunks"] > 0
    finally:
        srv.stop()
