"""Replicas given each other as peers (``--peers``) but serving different stores:
every save failed with ``MissingChunks`` (its chunks went to one replica's store,
its manifest to the other's) and ``ckptd ls`` showed an empty table, exit 0. Each
store has an id (``cluster/store-id``) that every server reads at start and
``GET /v1/cluster`` shows, so the list is refused in one line naming both
replicas, by the CLI and by a new ``Checkpointer``, before anything is saved."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import InvalidRequest
from tests.cli_runs import ckptd as run_ckptd
from tests.cluster.conftest import Replica
from tests.integration.test_cli_mistakes import assert_short_usage_error

pytestmark = pytest.mark.timeout(180)


def _ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    return run_ckptd(*args, environ={**env, "COLUMNS": "120"})


@pytest.fixture
def split_pair(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """The probe's mistake: two replicas that list each other, each over a store of
    its own."""
    a = Replica(str(tmp_path / "s1"), tmp_path)
    b = Replica(str(tmp_path / "s2"), tmp_path)
    for r in (a, b):
        r.args = ["--peers", f"{a.url},{b.url}", "--advertise-url", r.url]
    try:
        a.start(), b.start()
        yield a, b
    finally:
        a.stop(), b.stop()


def test_the_cli_refuses_replicas_of_different_stores_in_one_line(
        split_pair: tuple[Replica, Replica]) -> None:
    a, b = split_pair
    for command in (["ls"], ["ls", "split"]):  # (ls: an empty table, exit 0)
        done = _ckptd(*command, "--url", f"{a.url},{b.url}")
        assert_short_usage_error(done, a.url, b.url, "different stores", "--store")
    ids = {r.cluster().get("store_id") for r in (a, b)}
    assert len(ids) == 2 and None not in ids, ids


def test_a_checkpointer_over_replicas_of_different_stores_is_refused_at_construction(
        split_pair: tuple[Replica, Replica], tmp_path: Path) -> None:
    a, b = split_pair
    with pytest.raises(InvalidRequest, match="different stores") as caught:
        Checkpointer(f"{a.url},{b.url}", "split", shm_dir=tmp_path / "shm", serve_peers=False)
    assert a.url in str(caught.value) and b.url in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1
    # (nothing was saved to either store)
    assert not (tmp_path / "s1" / "jobs").exists() and not (tmp_path / "s2" / "jobs").exists()
    # Given one, it learns the other (--peers) and leaves it out: its store is b's
    # (tests/cluster/test_replica_other_store.py).
    with Checkpointer(b.url, "split", shm_dir=tmp_path / "shm", serve_peers=False) as ckpt:
        assert ckpt.save(1, {"w": torch.randn(1000)}).wait(60).state == "committed"
    assert (tmp_path / "s2" / "jobs").exists() and not (tmp_path / "s1" / "jobs").exists()


def test_replicas_over_one_store_share_its_id_and_save(
        static_pair: tuple[Replica, Replica], tmp_path: Path) -> None:
    a, b = static_pair
    stored = json.loads((tmp_path / "store" / "cluster" / "store-id").read_bytes())
    assert a.cluster()["store_id"] == b.cluster()["store_id"] == stored["id"]
    urls = f"{a.url},{b.url}"
    with Checkpointer(urls, "one", shm_dir=tmp_path / "shm", serve_peers=False) as ckpt:
        state = {f"w{i}": torch.randn(100_000) for i in range(8)}
        assert ckpt.save(1, state).wait(60).state == "committed"
    done = _ckptd("ls", "--url", urls)
    assert done.returncode == 0 and "one" in done.stdout, (done.stdout, done.stderr)
    b.restart()  # a replica restarted reads the id it finds, it makes no new one
    assert b.cluster()["store_id"] == stored["id"]


def test_a_replica_on_every_interface_leases_under_its_host_name_and_is_told_to_advertise(
        tmp_path: Path) -> None:
    """``--host 0.0.0.0 --member-leases`` leased as ``0.0.0.0_8470`` in every
    container on the default port, so replicas took over one another's lease and
    one was listed; and advertised ``http://0.0.0.0:8470``, which no client
    reaches, without a word."""
    r = Replica(str(tmp_path / "store"), tmp_path, ["--host", "0.0.0.0", "--member-leases"])
    r.start()
    try:
        members = r.cluster()["members"]
        own = re.sub(r"[^A-Za-z0-9._-]", "_", f"{socket.gethostname()}:{r.port}")
        assert [m["id"] for m in members] == [own], members  # type: ignore[index,union-attr]
        said = [line for line in r.log().splitlines() if "--advertise-url" in line]
        assert len(said) == 1 and f"http://0.0.0.0:{r.port}" in said[0], r.log()
    finally:
        r.stop()


def test_two_live_replicas_with_one_member_id_say_so(tmp_path: Path) -> None:
    """Two replicas given one CKPTD_MEMBER_ID took over each other's lease in turn,
    each saying it held a lease, one listed."""
    env = {"CKPTD_MEMBER_ID": "same", "CKPTD_MEMBER_TTL": "1.5"}
    pair = [Replica(str(tmp_path / "store"), tmp_path, ["--member-leases"], env)
            for _ in range(2)]
    try:
        for r in pair:
            r.start()
        deadline = time.monotonic() + 15.0
        said: list[str] = []
        while not said and time.monotonic() < deadline:
            time.sleep(0.2)
            said = [line for r in pair for line in r.log().splitlines()
                    if "member id same is another live replica's too" in line]
        assert said and "CKPTD_MEMBER_ID" in said[0], [r.log() for r in pair]
    finally:
        for r in pair:
            r.stop()


def test_a_replica_missing_from_its_own_peers_list_is_told_to_advertise(
        tmp_path: Path) -> None:
    """(Found by a probe: ``--peers`` without this server's own URL was taken without a
    word, and routing by that list made it home of nothing.)"""
    other = Replica(str(tmp_path / "store"), tmp_path)
    r = Replica(str(tmp_path / "store"), tmp_path)
    r.args = ["--peers", f"{other.url}"]
    r.start()
    try:
        said = [line for line in r.log().splitlines() if "not in --peers" in line]
        assert len(said) == 1 and r.url in said[0] and "--advertise-url" in said[0], r.log()
        # (found by a probe: docs/multinode.md's replica command set no peer secret)
        secret = [line for line in r.log().splitlines() if "CKPTD_PEER_SECRET" in line]
        assert len(secret) == 1 and "the same on every replica" in secret[0], r.log()
    finally:
        r.stop()
