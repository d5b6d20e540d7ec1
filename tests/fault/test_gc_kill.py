"""Kill the garbage collector (SIGKILL, another process) at random points while
saves run in this one: nothing committed is ever lost, and the next collection
takes over the dead one's lease once it expires."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.errors import GcInProgress, MissingChunks
from ckptd.lifecycle.fence import read_state, sweep_live_until
from ckptd.lifecycle.gc import collect_garbage
from ckptd.lifecycle.retention import RetentionPolicy, forget
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step, put_rank

JOB = "job"
LEASE = 1.5
_COLLECTOR = """
import asyncio, sys
from ckptd.lifecycle.gc import collect_garbage
from ckptd.store import LocalStore
store = LocalStore(sys.argv[1], fsync=False)
print("ready", flush=True)
report = asyncio.run(collect_garbage(store, grace=0.05, lease=float(sys.argv[2])))
print("done", report.chunks_deleted, flush=True)
"""


async def _save(repo: Repository, step: int) -> None:
    """One step, re-sent until it commits (a save that raced a sweep fails cleanly)."""
    for _ in range(50):
        try:
            for manifest, chunks in demo_step(JOB, step, 2, rows=64):
                await put_rank(repo, manifest, chunks)
            assert (await repo.commit(JOB, step)).state == "committed"
            return
        except (MissingChunks, GcInProgress):
            await asyncio.sleep(0.05)
    raise AssertionError(f"step {step} never committed")


async def _outlast_dead_collector(repo: Repository) -> None:
    """Waits until a killed collector's lease has run out (a sweep's: and its margin)."""
    state, _ = await read_state(repo.store)
    until = sweep_live_until(state) if state.phase == "sweeping" else state.expires_at
    await asyncio.sleep(max(0.0, until - time.time()) + 0.05)


@pytest.mark.slow
async def test_killing_the_collector_loses_nothing_committed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    repo = Repository(LocalStore(root, fsync=False))
    step = 0
    for _ in range(12):
        step += 1
        await _save(repo, step)
    rng = random.Random()
    kills = 0
    span = 0.25  # at least; how long a whole collection takes after "ready", measured below
    for rounds in range(1, 31):
        # At least 10 rounds, and on until 3 of them killed the collector mid-way:
        # whether a random delay lands inside a collection of ~0.1 s is chance
        # (10 rounds gave fewer than 3 kills about one run in ten).
        if rounds > 10 and kills >= 3:
            break
        # Garbage for the collector: forget all but the last three steps.
        await forget(repo, JOB, RetentionPolicy(keep_last=3))
        proc = subprocess.Popen([sys.executable, "-c", _COLLECTOR, str(root), str(LEASE)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        delay = rng.uniform(0.0, span)
        save = asyncio.create_task(_save(repo, step + 1))
        while time.monotonic() - t0 < delay and proc.poll() is None:
            await asyncio.sleep(0.005)
        killed = proc.poll() is None
        if killed:
            proc.kill()
            kills += 1
        else:
            span = max(span, time.monotonic() - t0)
        proc.wait()
        proc.stdout.close()
        await save
        step += 1
        if killed:
            # Let the dead collector's lease run out, so the next round's collector
            # takes it over and then really collects (were it to wait out the lease
            # instead, its kill would land in the wait and its time inflate ``span``).
            await _outlast_dead_collector(repo)
        for s in await repo.step_numbers(JOB):
            if await repo.try_read_commit(JOB, s) is not None:
                assert (await repo.verify(JOB, s)).ok, s
    assert kills >= 3  # rounds that really killed it mid-way
    await _outlast_dead_collector(repo)
    report = await collect_garbage(repo.store, grace=0.0, lease=LEASE)
    assert report.chunks_kept > 0
    committed = [s for s in await repo.step_numbers(JOB)
                 if await repo.try_read_commit(JOB, s) is not None]
    assert committed[-3:] == [step - 2, step - 1, step] or step in committed
    for s in committed:
        assert (await repo.verify(JOB, s)).ok, s
