"""A replica that hangs (stopped: the kernel still takes its connections and bytes)
holds a save for seconds, not a request timeout: the request waiting on it has the
replica probed, the probe marks it down, and the request goes to the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.cluster import home, job_key
from tests.cluster.conftest import Replica


def test_a_save_leaves_a_hung_replica_for_the_next_within_seconds(
        static_pair: tuple[Replica, Replica], tmp_path: Path) -> None:
    a, b = static_pair
    urls = [a.url, b.url]
    job = next(j for j in (f"hang-{i}" for i in range(1000)) if home(job_key(j), urls) == a.url)
    with Checkpointer(",".join(urls), job, chunk_size=1 << 20, shm_dir=tmp_path / "shm",
                      serve_peers=False, timeout=60.0) as ckpt:
        state = {"w": torch.randn(2 << 20)}
        assert ckpt.save(1, state).wait(60).state == "committed"
        assert a.proc is not None
        a.proc.send_signal(signal.SIGSTOP)
        state["w"].add_(1.0)
        t0 = time.monotonic()
        assert ckpt.save(2, state).wait(120).state == "committed"
        took = time.monotonic() - t0
        # (a request timeout is 60 s: before, the save waited it out at least once)
        assert took < 30.0, f"the save waited {took:.1f}s on the hung replica"
        got = {"w": torch.zeros(2 << 20)}
        ckpt.restore(got, step=2, tiers=("store",))
        assert torch.equal(got["w"], state["w"])


def test_probes_of_live_busy_replicas_mark_none_down(
        static_pair: tuple[Replica, Replica], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Probed after 50 ms, nearly every request of a save over two live replicas has
    its replica asked: each answers, so none is marked down and nothing is retried."""
    monkeypatch.setenv("CKPTD_SUSPECT_AFTER", "0.05")
    a, b = static_pair
    with Checkpointer(f"{a.url},{b.url}", "busy", chunk_size=1 << 20,
                      shm_dir=tmp_path / "shm", serve_peers=False, timeout=60.0) as ckpt:
        state = {"w": torch.randn(2 << 20)}
        for step in (1, 2):
            state["w"].add_(1.0)
            assert ckpt.save(step, state).wait(120).state == "committed"
        got = {"w": torch.zeros(2 << 20)}
        ckpt.restore(got, step=2, tiers=("store",))
        assert torch.equal(got["w"], state["w"])
        members = ckpt.transport.members  # type: ignore[attr-defined]
        assert members.failovers == 0 and members.live() == [a.url, b.url]


def test_a_cli_command_over_a_list_passes_a_hung_replica_over(
        static_pair: tuple[Replica, Replica], tmp_path: Path) -> None:
    """The CLI asks each URL once before its first call: a replica that does not
    answer is passed over with a warning (its calls go to the other), where the
    command used to wait a request timeout on it, five times."""
    a, b = static_pair
    urls = f"{a.url},{b.url}"
    with Checkpointer(urls, "j1", shm_dir=tmp_path / "shm", serve_peers=False) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(8)}).wait(60).state == "committed"
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_ANSWER_WITHIN"] = "3"  # (the wait for a replica's first answer)
    for command in (["ls", "j1"], ["verify", "j1"]):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "ckptd", *command, "--url", urls],
                              capture_output=True, text=True, env=env, timeout=120)
        took = time.monotonic() - t0
        assert done.returncode == 0, done.stdout + done.stderr
        assert a.url in done.stderr and "next one" in done.stderr, done.stderr
        assert took < 30.0, f"ckptd {' '.join(command)} took {took:.1f} s"
