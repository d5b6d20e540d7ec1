"""Many OS processes commit into one local directory at once; nothing is lost or doubled.

Four processes are the four ranks of job ``shared`` and save steps 1..N at their own
uneven pace, each calling commit after its manifest (so commits of one step race,
and commits of different steps race to move ``latest``); three more processes save
two other jobs into the same directory. Afterwards every step is committed exactly
once, every record and manifest checks out, and ``latest`` is N for every job.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.format import Ref, commit_key, latest_key
from ckptd.hashing import document_hash
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.manifests import demo_step
from ckptd.validation import validate_step

STEPS = 10
JOBS = {"shared": 4, "pair": 2, "solo": 1}  # job -> world size: one process per rank

WORKER = r"""
import asyncio, json, os, random, sys, time
from ckptd.repository import Repository
from ckptd.store.local import LocalStore
from ckptd.testing.manifests import demo_step, put_rank

root, job, world, rank, steps, go = sys.argv[1:7]
world, rank, steps = int(world), int(rank), int(steps)
wrote, lost = [], []

class RecordingStore(LocalStore):
    # Counts the commit records this process created: across all processes, each
    # step's record must be created exactly once.
    async def put_if_absent(self, key, data):
        created = await super().put_if_absent(key, data)
        if key.endswith("/commit.json"):
            (wrote if created else lost).append(key)
        return created

async def main():
    repo = Repository(RecordingStore(root, fsync=True))
    rnd = random.Random(f"{job}/{rank}")
    out = []
    for step in range(1, steps + 1):
        manifest, chunks = demo_step(job, step, world, rows=16, cols=512)[rank]
        digest = await put_rank(repo, manifest, chunks)
        await asyncio.sleep(rnd.random() * 0.01)  # uneven pace: ranks drift apart
        status = await repo.commit(job, step)
        out.append({
            "step": step, "digest": digest, "state": status.state,
            "record": status.record.digest() if status.record else None,
        })
    return out

print("ready", flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(go):  # start together, after the imports
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.002)
results = asyncio.run(main())
summary = {"job": job, "rank": rank, "results": results, "wrote": wrote, "lost": lost}
print(json.dumps(summary), flush=True)
"""


@pytest.mark.timeout(60)
def test_processes_committing_into_one_directory(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    go = tmp_path / "go"
    env = dict(os.environ)
    for name in [k for k in env if k.startswith("CKPTD_")]:
        del env[name]
    procs = [
        (job, rank, subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), job, str(world), str(rank), str(STEPS),
             str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ))
        for job, world in JOBS.items() for rank in range(world)
    ]
    try:
        for _, _, p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        started = time.monotonic()
        go.touch()
        outputs = []
        for job, rank, p in procs:
            out, err = p.communicate(timeout=40)
            assert p.returncode == 0, f"{job} rank {rank} failed:\n{err}"
            outputs.append(json.loads(out.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert elapsed < 30

    asyncio.run(check_store(root, outputs))


async def check_store(root: Path, outputs: list[dict]) -> None:  # type: ignore[type-arg]
    # Temporaries never outlive their writer.
    leftovers = [p for p in root.rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []

    # Each step's commit record was created by exactly one process.
    created: dict[str, int] = {}
    for o in outputs:
        for key in o["wrote"]:
            created[key] = created.get(key, 0) + 1
    expected_keys = {commit_key(j, s) for j in JOBS for s in range(1, STEPS + 1)}
    assert created == dict.fromkeys(expected_keys, 1)

    store = LocalStore(root)
    repo = Repository(store)
    assert await repo.list_jobs() == sorted(JOBS)
    for job, world in JOBS.items():
        assert await repo.latest(job) == STEPS
        steps = await repo.list_steps(job)
        assert [(s.step, s.committed, s.ranks_present) for s in steps] == [
            (s, True, world) for s in range(1, STEPS + 1)
        ]
        records = {}
        for step in range(1, STEPS + 1):
            raw = await store.get(commit_key(job, step))
            record = await repo.read_commit(job, step)
            assert record.canonical() == raw
            records[step] = document_hash(raw)
            manifests = [await repo.read_manifest(job, step, r) for r in range(world)]
            assert validate_step(manifests) == record.report
            for rank, m in enumerate(manifests):  # nothing lost: what each rank sent
                assert m == demo_step(job, step, world, rows=16, cols=512)[rank][0]
        ref = Ref.parse(await store.get(latest_key(job)))
        assert ref.step == STEPS and ref.commit == records[STEPS]
        report = await repo.verify(job)
        assert report.ok and report.steps == list(range(1, STEPS + 1))

        # Every process saw the one record of each step, and every step committed
        # through the workers' own calls (the last rank in always sees all ranks).
        mine = [o for o in outputs if o["job"] == job]
        for step in range(1, STEPS + 1):
            seen = [r for o in mine for r in o["results"] if r["step"] == step]
            assert {r["record"] for r in seen if r["state"] == "committed"} == {records[step]}
            assert any(r["state"] == "committed" for r in seen)
            for o in mine:
                r = next(r for r in o["results"] if r["step"] == step)
                ref_hash = (await repo.read_commit(job, step)).manifests[o["rank"]].hash
                assert r["digest"] == ref_hash
