"""Chaos: four data-parallel gloo ranks under ``torchrun --max-restarts``, a
snapshot every few steps, and an injector that SIGKILLs a rank at planned steps
(deterministic per seed), sometimes deleting its shared-memory pool first (a lost
node), once also corrupting the store's copy of a chunk that the restore needs.
torchrun restarts the group; the workers re-adopt their pools, restore from them,
from peers or from the store, and finish. The final parameters and optimizer
state must equal, bitwise, those of the same steps run without a failure.

Per failure the run reports the time from the kill to the next completed step
(MTTR), the steps redone, and the bytes each rank restored from each tier
(``chaos-report.json`` next to the run's output; ``pytest -s`` prints it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))
from chaos_worker import Kill, kill_plan  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

WORKER = Path(__file__).parent / "chaos_worker.py"
WORLD = 4
STEPS = 36
EVERY = 3
KILLS = 4
SEED = 2024
TOKEN = "chaos-token"


def run(out: Path, url: str, job: str, plan: list[Kill], store: Path, shm: Path,
        timeout: float = 240.0) -> str:
    """Runs the worker under torchrun until it finishes; its output."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", f"--max-restarts={len(plan) + 1}",
           "--monitor-interval=0.1", str(WORKER), str(out), url, job, str(STEPS), str(EVERY),
           json.dumps([asdict(k) for k in plan]), str(store)]
    env = dict(os.environ)
    env.pop("CKPTD_TOKEN", None)
    env.update(OMP_NUM_THREADS="1", CHAOS_TOKEN=TOKEN, CKPTD_SHM_DIR=str(shm),
               CKPTD_PEER_TIMEOUT="5")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: kill the whole tree.
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(psutil.Error):
                child.kill()
        output, _ = proc.communicate()
        pytest.fail(f"{job} ran past {timeout} s:\n{output.decode(errors='replace')[-8000:]}")
    text = output.decode(errors="replace")
    (out / "torchrun.log").write_text(text)
    if proc.returncode != 0:
        pytest.fail(f"{job} exited {proc.returncode}:\n{text[-10000:]}")
    return text


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def events(out: Path) -> list[dict[str, Any]]:
    lines = []
    for r in range(WORLD):
        path = out / f"events-{r}.jsonl"
        if path.exists():
            lines += [json.loads(line) for line in path.read_text().splitlines() if line]
    return lines


@pytest.fixture
def chaos_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Fast liveness; short claims, so a killed rank's claimed chunks come back soon.
    monkeypatch.setenv("CKPTD_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("CKPTD_CLAIM_LEASE", "2")
    srv = ServerProcess(store=tmp_path / "store", token=TOKEN)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def shm_root() -> Any:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"ckptd-chaos-{secrets.token_hex(4)}"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(plan: list[Kill], kills: list[dict[str, Any]], evs: list[dict[str, Any]]
           ) -> list[dict[str, Any]]:
    """Per failure: MTTR, steps redone, bytes per tier of every rank's restore."""
    out = []
    for k in sorted(kills, key=lambda k: k["attempt"]):
        nxt = k["attempt"] + 1
        firsts = [e for e in evs if e["kind"] == "first_step" and e["attempt"] == nxt]
        restores = {e["rank"]: e for e in evs if e["kind"] == "restored" and e["attempt"] == nxt}
        assert len(firsts) == WORLD and len(restores) == WORLD, (k, firsts, restores)
        restored = {e["step"] for e in restores.values()}
        assert len(restored) == 1, restores
        (restored_step,) = restored
        done = max(e["t"] for e in firsts)  # the step completes when every rank did it
        out.append({
            "attempt": k["attempt"],
            "victim": k["rank"],
            "killed_at_step": k["step"],
            "lost_node": k["wipe"],
            "corrupted_chunk": k.get("corrupted_chunk"),
            "restored_step": restored_step,
            "steps_redone": (k["step"] - 1) - restored_step,
            "mttr_s": round(done - k["t"], 3),
            "restore_s": {r: round(e["seconds"], 3) for r, e in sorted(restores.items())},
            "bytes_from": {r: e["bytes_from"] for r, e in sorted(restores.items())},
            "bytes": {r: e["bytes"] for r, e in sorted(restores.items())},
            "problems": {r: len(e["problems"]) for r, e in sorted(restores.items())},
        })
    return out


def test_chaos_kills_restore_bitwise(
    chaos_server: ServerProcess, shm_root: Path, tmp_path: Path
) -> None:
    store = chaos_server.store
    ref = tmp_path / "ref"
    run(ref, chaos_server.url, "ref", [], store, shm_root)
    expected = results(ref)
    assert all(r["digests"] == expected[0]["digests"] for r in expected)  # replicas agree
    assert all(r["attempt"] == 0 and r["latest"] == STEPS for r in expected)

    plan = kill_plan(SEED, STEPS, WORLD, KILLS, EVERY)
    assert len(plan) >= 3 and any(k.wipe for k in plan) and any(not k.wipe for k in plan)
    out = tmp_path / "chaos"
    run(out, chaos_server.url, "chaos", plan, store, shm_root)

    # Every planned kill happened, once, where planned; then the run finished.
    kills = [json.loads(line) for line in (out / "kills.jsonl").read_text().splitlines()]
    assert len(kills) == len(plan) >= 3
    for k, planned in zip(sorted(kills, key=lambda k: k["attempt"]), plan, strict=True):
        assert (k["attempt"], k["rank"], k["step"], k["wipe"]) == (
            planned.attempt, planned.rank, planned.step, planned.wipe)
    final = results(out)
    assert all(r["attempt"] == len(plan) for r in final)
    # Bitwise the same parameters and optimizer state as the run without failures.
    for r in final:
        assert r["digests"] == expected[0]["digests"], f"rank {r['rank']} differs"
        assert r["latest"] == STEPS

    failures = report(plan, kills, events(out))
    doc = {"seed": SEED, "world": WORLD, "steps": STEPS, "every": EVERY,
           "kills": len(kills), "failures": failures}
    (tmp_path / "chaos-report.json").write_text(json.dumps(doc, indent=2))
    print("\nchaos report:", json.dumps(doc, indent=1))
    print(f"{'kill':>4} {'rank':>4} {'step':>4} {'lost':>5} {'restored':>8} {'redone':>6} "
          f"{'MTTR s':>7}  bytes per tier (victim)")
    for f in failures:
        print(f"{f['attempt']:>4} {f['victim']:>4} {f['killed_at_step']:>4} "
              f"{f['lost_node']!s:>5} {f['restored_step']:>8} {f['steps_redone']:>6} "
              f"{f['mttr_s']:>7.2f}  {f['bytes_from'][f['victim']]}")

    saved = json.loads((tmp_path / "chaos-report.json").read_text())
    assert saved["kills"] == len(plan) and len(saved["failures"]) == len(plan)
    total_local = 0
    for f in failures:
        assert 0 < f["mttr_s"] < 120
        assert 0 <= f["steps_redone"] < 2 * EVERY + 1
        victim = f["victim"]
        for r, tiers in f["bytes_from"].items():
            # Each rank fetched its state's distinct chunks (repeats are copied).
            assert 0 < sum(tiers.values()) <= f["bytes"][r]
            total_local += tiers.get("local", 0)
        if f["lost_node"]:
            assert f["bytes_from"][victim].get("local", 0) == 0  # its pool was gone
        if f["corrupted_chunk"]:
            # The store's copy is bad, and the lost node got everything from peers.
            tiers = f["bytes_from"][victim]
            assert tiers.get("store", 0) == 0 and tiers.get("peer", 0) > 0, tiers
            resp = httpx.post(f"{chaos_server.url}/v1/jobs/chaos/verify",
                              params={"step": f["restored_step"]},
                              headers=chaos_server.headers(), timeout=60)
            assert f["corrupted_chunk"] in resp.json()["bad_chunks"]
    assert total_local > 0  # surviving ranks restored from their own pools
