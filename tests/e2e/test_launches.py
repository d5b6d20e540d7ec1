"""Launches across torchrun agents: two agents (``--nnodes=2``, c10d rendezvous) on
127.0.0.1, one rank each, as two nodes would run them. Rank 1 fails, so its agent
counts a restart and rank 0's restarts its worker uncounted: their
``TORCHELASTIC_RESTART_COUNT`` differ. The process group still forms
(``ckptd.client.distributed.init_process_group`` with torch's shared agent store;
plain ``dist.init_process_group`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
what docs/design/023-launches.md tells several nodes to run), the ranks agree on
the launch without being told, and step 10, which rank 0 of the dead launch had
saved, commits with the new launch's bytes on every rank: never mixed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import ServerProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]

WORKER = Path(__file__).parent / "workers" / "launches.py"


def _agents(tmp: Path, name: str, mode: str, env: dict[str, str]) -> list[dict[str, Any]]:
    server = ServerProcess(store=tmp / f"{name}-store")
    server.start()
    out = tmp / name
    out.mkdir()
    port = free_port()
    full = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_URL=server.url,
                CKPTD_SHM_DIR=str(tmp / f"{name}-shm"), **env)
    full.pop("CKPTD_TOKEN", None)
    (tmp / f"{name}-shm").mkdir()
    procs = []
    try:
        for host in (True, False):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc-per-node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
                   f"--rdzv-conf=is_host={str(host).lower()}", "--local-addr=127.0.0.1",
                   "--max-restarts=1", "--monitor-interval=0.2",
                   str(WORKER), str(out), name, mode]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, env=full,
                                          start_new_session=True))
        outputs = []
        for proc in procs:
            try:
                output, _ = proc.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                for p in procs:
                    _kill_tree(p)
                texts = [p.communicate()[0].decode(errors="replace")[-4000:] for p in procs]
                pytest.fail(f"{name}: the agents ran past 240 s:\n" + "\n---\n".join(texts))
            outputs.append(output.decode(errors="replace"))
        for proc, text in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, f"{name}: an agent exited {proc.returncode}:\n" \
                                         f"{text[-6000:]}"
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        for proc in procs:
            _kill_tree(proc)
        server.stop()


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """The agent and its workers (which torchrun starts in sessions of their own)."""
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    proc.wait()


def _check(results: list[dict[str, Any]]) -> None:
    # The agents counted differently: a prefix or id of the count would differ.
    assert {r["restart_count"] for r in results} == {"0", "1"}, results
    for r in results:
        assert r["launch"] == 2 and r["restored"] == 5, r
        assert "error" not in r, r
        # Step 10 holds this launch's bytes on every rank, rank 0's included (its
        # dead launch's manifest of step 10 was replaced, not committed beside).
        assert r["back"] == r["saved"], r
    incarnations = {r["incarnation"] for r in results}
    assert len(incarnations) == 1 and None not in incarnations, results


def test_the_helper_forms_the_group_after_agents_restart_apart(tmp_path: Path) -> None:
    """torchrun's defaults (the agent's shared store): the helper keyed its store
    prefix on the restart count and hung; the ranks now meet under a launch id they
    agreed on, which also names the launch."""
    _check(_agents(tmp_path, "helper", "helper", {}))


def test_plain_init_with_the_share_off_agrees_on_the_launch(tmp_path: Path) -> None:
    """What several nodes run: plain init, the agents' store sharing off, and a
    constant CKPTD_INCARNATION (a torchrun command line cannot vary it): the ranks
    agree through the group's store; before, rank 0 got Conflict and step 10
    committed rank 0's dead-launch shard beside rank 1's new one."""
    results = _agents(tmp_path, "plain", "plain",
                      {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                       "CKPTD_INCARNATION": "same-every-launch"})
    _check(results)
    assert results[0]["incarnation"].startswith("same-every-launch/group:")
