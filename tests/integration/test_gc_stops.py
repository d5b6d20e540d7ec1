"""A collection stopped, crashed or facing a damaged ``gc/state``, as an operator
meets it (an operator's probe): a SIGTERM mid-sweep hands the lease back and says
so in one line; a damaged state is reported by GET /v1/gc, not a 500, and
``ckptd gc`` through the server repairs it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.lifecycle.documents import GC_STATE_KEY, GcState
from tests.cli_runs import ckptd
from tests.conftest import ServerProcess

REPO = Path(__file__).resolve().parents[2]
DAMAGED = b"garbage\n"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    return {**env, "CKPTD_RETRIES": "0", "COLUMNS": "200"}


def _ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, env=_env(), cwd=REPO, timeout=60)


def _garbage(root: Path, n: int) -> None:
    """``n`` chunks that no step names (a sweep deletes them one by one)."""
    (root / "jobs").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        cid = hashlib.sha256(str(i).encode()).hexdigest()
        (root / "chunks" / cid[:2]).mkdir(parents=True, exist_ok=True)
        (root / "chunks" / cid[:2] / cid).write_bytes(b"x")


def _state(root: Path) -> dict[str, object]:
    try:
        loaded: dict[str, object] = json.loads((root / GC_STATE_KEY).read_bytes())
    except (FileNotFoundError, ValueError):
        return {}
    return loaded


def test_a_sigterm_mid_sweep_hands_the_lease_back_and_says_so(tmp_path: Path) -> None:
    """Before: exit 143 with nothing said, and gc/state left 'sweeping', so every
    save waited out the lease and its margin (about 2 minutes)."""
    root = tmp_path / "store"
    _garbage(root, 3000)
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "gc", "--grace", "0", "--url",
                             str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO)
    deadline = time.monotonic() + 30
    while _state(root).get("phase") != "sweeping" and proc.poll() is None:
        assert time.monotonic() < deadline, "the collection never swept"
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("interrupted: garbage collection 1 stopped while"), err
    assert "lease is handed back, so saves go on" in lines[0], err
    assert _state(root)["phase"] == "idle"
    # The next collection starts at once and deletes the rest.
    done = _ckptd("gc", "--grace", "0", "--url", str(root))
    assert done.returncode == 0, done.stderr
    assert "GC 2: freed" in done.stdout
    assert not [p for p in (root / "chunks").rglob("*") if p.is_file()]


def test_a_damaged_gc_state_is_reported_and_repaired_through_the_server(
        tmp_path: Path) -> None:
    """Before: GET /v1/gc answered 500, so `ckptd gc` (and --dry-run) through the
    server failed on its first status read, while the error told the operator to
    run exactly that."""
    srv = ServerProcess(store=tmp_path / "store", env={"CKPTD_GC_LEASE": "1"})
    srv.start()
    try:
        root = Path(srv.store)
        _garbage(root, 3)
        (root / "gc").mkdir(exist_ok=True)
        (root / GC_STATE_KEY).write_bytes(DAMAGED)
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            r = client.get("/v1/gc")
            assert r.status_code == 200, r.text
            state = r.json()["state"]
            assert state["phase"] == "damaged"
            assert GC_STATE_KEY in state["note"] and "a collection takes it over" in state["note"]
        dry = _ckptd("gc", "--dry-run", "--url", srv.url)
        assert dry.returncode == 0, dry.stderr
        assert "would free" in dry.stdout and "(a dry run leaves it)" in dry.stderr
        done = _ckptd("gc", "--grace", "0", "--url", srv.url)
        assert done.returncode == 0, done.stderr
        assert "damaged" in done.stderr and "GC 1: freed" in done.stdout, done
        assert _state(root)["phase"] == "idle"
    finally:
        srv.stop()


def test_a_save_held_by_a_killed_collector_is_logged_and_shown(server: ServerProcess) -> None:
    """Before: a killed collector's sweep held the next save for up to two minutes
    with nothing in the server's log, and GET /v1/gc did not say its collector had
    stopped."""
    root = Path(server.store)
    now = time.time()
    killed = GcState(generation=1, phase="sweeping", holder="killed", started_at=now - 4.0,
                     expires_at=now - 0.5)  # live for its margin: until now + 3 s
    (root / "gc").mkdir(parents=True, exist_ok=True)
    (root / GC_STATE_KEY).write_bytes(killed.canonical())
    with httpx.Client(base_url=server.url, timeout=30) as client:
        state = client.get("/v1/gc").json()["state"]
        assert state["collector_stopped"] is True, state
        assert "collector stopped renewing its lease" in state["note"], state
        # ``ckptd status`` says it too: the ranks' own logs do not (it said nothing)
        shown = ckptd("status", "--url", server.url, env={"COLUMNS": "400"})
        assert shown.returncode == 0, shown.stderr
        assert "gc: garbage collection 1's collector stopped renewing its lease" in (
            shown.stdout), shown.stdout
        r = client.post("/v1/chunks/missing", json={"ids": ["0" * 64], "claimer": "a"})
        assert r.status_code == 200, r.text
    said = [line for line in server.log().splitlines() if "a write waits for" in line]
    assert len(said) == 1, server.log()
    assert "garbage collection 1's collector stopped renewing its lease" in said[0]
    assert "UTC" in said[0]


def test_a_newer_gc_state_is_a_phase_of_get_gc_and_shown_by_status(
        server: ServerProcess) -> None:
    """A gc/state a newer ckptd wrote stops every save of this one (it cannot know
    that version's protocol). GET /v1/gc failed with a 500 over it, and the
    operator's tools said nothing of why saves failed."""
    root = Path(server.store)
    doc = json.loads(GcState(generation=4, phase="idle", holder="", started_at=0.0,
                             expires_at=0.0).canonical())
    doc["version"] = 2
    (root / "gc").mkdir(parents=True, exist_ok=True)
    (root / GC_STATE_KEY).write_text(json.dumps(doc))
    r = httpx.get(f"{server.url}/v1/gc", timeout=30)
    assert r.status_code == 200, r.text
    state = r.json()["state"]
    assert state["phase"] == "unsupported", state
    assert GC_STATE_KEY in state["note"] and "newer" in state["note"], state
    shown = ckptd("status", "--url", server.url, env={"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    assert f"gc: {GC_STATE_KEY}" in shown.stdout, shown.stdout


def test_a_scheduled_collection_is_a_run_that_ckptd_gc_follows(tmp_path: Path) -> None:
    """(Found by a probe of the docs.) The server's scheduled collection
    (--gc-interval) begins as the server starts and waits out its grace; GET /v1/gc
    did not show it running, and ``ckptd gc`` through the server waited out its own
    run's grace (600 s by default), then was refused the lease the scheduled one
    held. It now follows the scheduled one, as operations.md says."""
    srv = ServerProcess(store=tmp_path / "store",
                        extra_args=["--gc-interval", "3600", "--gc-grace", "3"])
    srv.start()
    try:
        deadline = time.monotonic() + 10
        running = None
        while running is None and time.monotonic() < deadline:
            running = httpx.get(f"{srv.url}/v1/gc", timeout=10).json()["running"]
            time.sleep(0.05)
        assert running is not None and running["grace"] == 3, running
        again = httpx.post(f"{srv.url}/v1/gc/runs", timeout=10).json()
        assert again["id"] == running["id"]  # the scheduled run, followed
        done = ckptd("gc", "--url", srv.url, env={"COLUMNS": "200"})
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        srv.stop()


def test_a_read_token_on_every_job_is_told_it_lacks_the_role_for_gc(tmp_path: Path) -> None:
    """(Found by a probe of the docs.) A read token on '*' was told, for ``ckptd gc``,
    that it needed "a token for every job ('*')": it had one; it lacks the role."""
    from ckptd.tokens import create_token

    tokens = tmp_path / "tokens.json"
    read, _ = create_token(tokens, "*", "read")
    srv = ServerProcess(store=tmp_path / "store", token="ADMIN-token",
                        extra_args=["--tokens-file", str(tokens)])
    srv.start()
    try:
        r = httpx.post(f"{srv.url}/v1/gc", params={"dry_run": "true"},
                       headers={"Authorization": f"Bearer {read}"}, timeout=30)
    finally:
        srv.stop()
    assert r.status_code == 403, r.text
    message = r.json()["message"]
    assert "role admin on every job" in message and "needs a token for every" not in message



def test_a_save_held_by_a_sweep_is_said_in_the_ranks_log(
        server: ServerProcess, shm: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: a save that a killed collector's sweep held (up to two minutes) said
    nothing in the rank's log: the server's log and ``ckptd status`` did."""
    from ckptd.client import Checkpointer
    from ckptd.client.save import chunks

    monkeypatch.setattr(chunks, "SLOW_ANSWER_S", 0.5, raising=False)
    root = Path(server.store)
    with Checkpointer(server.url, "held", rank=0, world_size=1, shm_dir=shm,
                      serve_peers=False, heartbeat_interval=60) as ckpt:
        now = time.time()
        killed = GcState(generation=1, phase="sweeping", holder="killed",
                         started_at=now - 2.0, expires_at=now)  # live until now + 2 s
        (root / "gc").mkdir(parents=True, exist_ok=True)
        (root / GC_STATE_KEY).write_bytes(killed.canonical())
        with caplog.at_level(logging.WARNING, logger="ckptd.client.save.chunks"):
            assert ckpt.save(1, {"w": torch.ones(1024)}).wait(60).state == "committed"
    said = [r.getMessage() for r in caplog.records if "has not said which" in r.getMessage()]
    assert said and "held/0 step 1" in said[0] and "ckptd status" in said[0], said
