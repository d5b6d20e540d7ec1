"""One replica of three restarted with a mistyped ``--store`` (``s3://b/ckpts`` for
``s3://b/ckpt``, found by an operator's probe): it made a new empty store without a
word, and from then on every new ``Checkpointer`` failed at construction, even one
given only a healthy replica's URL (it learns the others from ``/v1/cluster``), with
advice to give one URL that did not help; the healthy replicas logged nothing. Now a
client keeps to the store of the URL it was given and leaves the other replica out
with one warning, and the healthy replicas name it in their logs, once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import InvalidRequest
from tests.cluster.conftest import BUCKET, Replica, s3_env
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(180)

CHECK_S = 0.3  # the replicas' CKPTD_PEER_CHECK_INTERVAL: several checks in a test


@pytest.fixture(scope="module")
def split_three(moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Replica, Replica, Replica]]:
    """Replicas a and b over one prefix, c (their --peers too) over that prefix with an
    ``s`` added; c started last, as the probe restarted it."""
    workdir = tmp_path_factory.mktemp("split")
    prefix = uuid.uuid4().hex
    store = f"s3://{BUCKET}/{prefix}?endpoint={moto_endpoint}"
    typo = f"s3://{BUCKET}/{prefix}s?endpoint={moto_endpoint}"
    env = {"CKPTD_PEER_CHECK_INTERVAL": str(CHECK_S)}
    a, b, c = (Replica(s, workdir, env=env) for s in (store, store, typo))
    for r in (a, b, c):
        r.args = ["--peers", f"{a.url},{b.url},{c.url}"]
    try:
        a.start(), b.start(), c.start()
        yield a, b, c
    finally:
        a.stop(), b.stop(), c.stop()


def _heard_by(replica: Replica) -> list[object]:
    """The store ids ``replica``'s ``/v1/cluster`` shows its members serve."""
    members = replica.cluster()["members"]
    assert isinstance(members, list)
    return [m.get("store_id") for m in members]


def _said(replica: Replica, *words: str) -> list[str]:
    return [line for line in replica.log().splitlines() if all(w in line for w in words)]


def test_a_checkpointer_given_a_healthy_replica_leaves_the_other_store_out_and_saves(
        split_three: tuple[Replica, Replica, Replica], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    a, b, c = split_three
    monkeypatch.setenv("CKPTD_CLUSTER_REFRESH", "0.2")  # several refreshes: one warning
    caplog.set_level(logging.WARNING, logger="ckptd.client")
    state = {f"w{i}": torch.randn(50_000) for i in range(6)}
    with Checkpointer(a.url, "split", shm_dir=tmp_path / "shm", serve_peers=False) as ckpt:
        assert ckpt.save(1, state).wait(60).state == "committed"
        time.sleep(0.5)
        assert ckpt.save(2, state).wait(60).state == "committed"
    with Checkpointer(b.url, "split", shm_dir=tmp_path / "shm2", serve_peers=False) as ckpt:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.restore(target, tiers=["store"])
    assert all(torch.equal(target[k], state[k]) for k in state)
    warned = [r.getMessage() for r in caplog.records if c.url in r.getMessage()]
    # (once per client: the Checkpointer given b's URL has its own list of replicas)
    assert len(warned) == 2, warned
    assert "serves another store" in warned[0] and "--store" in warned[0], warned
    assert c.cluster()["store_id"][:8] in warned[0]  # type: ignore[index]
    assert len(warned[0].splitlines()) == 1
    # (nothing of the job went to the replica on the other store)
    assert httpx.get(f"{c.url}/v1/jobs", timeout=5).json()["jobs"] == []
    # Every replica's URL given (a deployment's CKPTD_URL): most serve one store, so
    # the client keeps to it and leaves the other out (it refused before).
    caplog.clear()
    with Checkpointer(f"{a.url},{b.url},{c.url}", "split3", shm_dir=tmp_path / "shm3",
                      serve_peers=False) as ckpt:
        assert ckpt.save(1, state).wait(60).state == "committed"
    warned = [r.getMessage() for r in caplog.records if c.url in r.getMessage()]
    assert len(warned) == 1 and "serves another store" in warned[0], warned
    # Two URLs given, one on each store, are still refused, in one line naming both.
    with pytest.raises(InvalidRequest, match="different stores") as caught:
        Checkpointer(f"{a.url},{c.url}", "split2", shm_dir=tmp_path / "shm",
                     serve_peers=False)
    said = str(caught.value)
    assert a.url in said and c.url in said and len(said.splitlines()) == 1


def test_the_healthy_replicas_name_the_peer_on_another_store_once(
        split_three: tuple[Replica, Replica, Replica]) -> None:
    a, b, c = split_three
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not all(_said(r, c.url, "another store")
                                                  for r in (a, b)):
        time.sleep(0.1)
    time.sleep(4 * CHECK_S)  # (several checks more: still one line)
    for healthy in (a, b):
        said = _said(healthy, c.url, "another store")
        assert len(said) == 1 and "--store" in said[0], healthy.log()
        assert "check that replica's --store" in said[0], healthy.log()
    # The replica on the new store names each peer once, and itself as the odd one.
    for peer in (a, b):
        said = _said(c, peer.url, "another store")
        assert len(said) == 1 and "check this replica's --store" in said[0], c.log()
        assert "made its store as it started" in said[0], c.log()


def test_status_given_a_healthy_replica_shows_the_one_left_out(
        split_three: tuple[Replica, Replica, Replica]) -> None:
    a, _, c = split_three
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run([sys.executable, "-m", "ckptd", "status", "--url", a.url],
                          capture_output=True, text=True, timeout=60,
                          env={**env, **s3_env(), "COLUMNS": "200"})
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert c.url in done.stdout and "another store" in done.stdout, done.stdout
    assert done.stderr.count(c.url) == 1, done.stderr  # the routing's warning, once


def test_serve_check_says_the_peers_serve_another_store(
        split_three: tuple[Replica, Replica, Replica], moto_endpoint: str) -> None:
    """``serve --check`` passed the probe's mistyped prefix: a new store, its peers up."""
    a, b, _ = split_three
    port = free_port()
    typo = f"s3://{BUCKET}/{uuid.uuid4().hex}?endpoint={moto_endpoint}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--check", "--store", typo, "--port",
         str(port), "--peers", f"{a.url},{b.url},http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60, env={**env, **s3_env(), "COLUMNS": "300"})
    assert done.returncode == 0 and "ok: would serve" in done.stdout, (done.stdout, done.stderr)
    for peer in (a, b):
        said = [line for line in done.stderr.splitlines() if peer.url in line]
        assert len(said) == 1 and "another store" in said[0], done.stderr
        assert "no store id" in said[0] and "--store" in said[0], done.stderr


def test_a_running_checkpointer_leaves_out_a_replica_restarted_on_another_store(
        moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The probe's restart under clients that already route over both replicas:
    their next save's chunks went to the new empty store and the commit failed. One
    given both URLs keeps to the store it has used, as one given a's."""
    monkeypatch.setenv("CKPTD_CLUSTER_REFRESH", "0.3")
    caplog.set_level(logging.WARNING, logger="ckptd.client")
    prefix = uuid.uuid4().hex
    store = f"s3://{BUCKET}/{prefix}?endpoint={moto_endpoint}"
    env = {"CKPTD_PEER_CHECK_INTERVAL": str(CHECK_S)}
    a, b = Replica(store, tmp_path, env=env), Replica(store, tmp_path, env=env)
    for r in (a, b):
        r.args = ["--peers", f"{a.url},{b.url}"]
    state = {f"w{i}": torch.randn(50_000) for i in range(8)}
    try:
        a.start(), b.start()
        ckpts = [Checkpointer(url, f"moved{i}", shm_dir=tmp_path / f"shm{i}",
                              serve_peers=False)
                 for i, url in enumerate((a.url, f"{a.url},{b.url}"))]
        try:
            for ckpt in ckpts:
                assert ckpt.save(1, state).wait(60).state == "committed"
            b.stop()
            b.store = f"s3://{BUCKET}/{prefix}s?endpoint={moto_endpoint}"
            b.start()
            moved = b.cluster()["store_id"]
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and moved not in _heard_by(a):
                time.sleep(0.1)  # (a's peer check hears b's new store id)
            assert moved in _heard_by(a), a.cluster()
            time.sleep(0.4)  # (the clients' next refresh is due)
            for ckpt in ckpts:
                for step in (2, 3):  # (16 new chunks: some would be b's, by their ids)
                    state = {k: torch.randn(50_000) for k in state}
                    assert ckpt.save(step, state).wait(60).state == "committed"
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                ckpt.restore(target, tiers=["store"])
                assert all(torch.equal(target[k], state[k]) for k in state)
        finally:
            for ckpt in ckpts:
                ckpt.close()
        warned = [r.getMessage() for r in caplog.records if b.url in r.getMessage()
                  and "another store" in r.getMessage()]
        assert len(warned) == 2, [r.getMessage() for r in caplog.records]  # (one a client)
        assert httpx.get(f"{b.url}/v1/jobs", timeout=5).json()["jobs"] == []
        assert len(_said(a, b.url, "another store")) == 1, a.log()
    finally:
        a.stop(), b.stop()
