"""Two settings a user meets on a first multi-rank or small-disk run (found by a
probe): ``CKPTD_PEER_PORT`` is the first rank's port on a host, each local rank
taking the next (torchrun's ranks all bound the same one: every rank but the
first failed); and a store whose disk has less free space than the server keeps
free is said at start, and its refusals say which setting that is."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd import knobs
from ckptd.client.peer.server import PeerServer
from ckptd.errors import StoreFull, Unavailable
from ckptd.lifecycle.capacity import SpaceGuard
from ckptd.store.local import LocalStore

pytestmark = pytest.mark.timeout(120)


def _free_port_pair() -> int:
    """A port whose next one is free too (bounded tries)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise AssertionError("no two free ports in a row")


def test_each_local_rank_serves_peers_on_its_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _free_port_pair()
    monkeypatch.setenv("CKPTD_PEER_PORT", str(base))
    servers = []
    try:
        for local in (0, 1):
            monkeypatch.setenv("LOCAL_RANK", str(local))
            server = PeerServer(host="127.0.0.1")
            server.start()
            servers.append(server)
        assert [s.port for s in servers] == [base, base + 1]
    finally:
        for server in servers:
            server.close()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CKPTD_PEER_PORT", "65535")
    with pytest.raises(Exception, match="no port for local rank 1"):
        knobs.peer_port()
    monkeypatch.delenv("CKPTD_PEER_PORT")
    assert knobs.peer_port() == 0  # unset: the OS chooses, whatever the local rank


def test_a_peer_port_in_use_says_what_to_do_in_one_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        server = PeerServer(host="127.0.0.1", port=held.getsockname()[1])
        with pytest.raises(Unavailable) as err:
            server.start()
    assert "CKPTD_PEER_PORT + LOCAL_RANK" in str(err.value), err.value
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one error


def test_a_full_store_names_the_setting_it_is_under(tmp_path: Path) -> None:
    guard = SpaceGuard(LocalStore(tmp_path / "s"), min_free_bytes=1 << 62,
                       warn_free_bytes=1 << 62)
    with pytest.raises(StoreFull) as err:
        asyncio.run(guard())
    assert "CKPTD_MIN_FREE_BYTES" in str(err.value), err.value


def test_serve_says_at_start_that_the_disk_is_under_what_it_keeps_free(tmp_path: Path) -> None:
    env = {**os.environ, "CKPTD_MIN_FREE_BYTES": str(1 << 62)}
    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--store",
                           str(tmp_path / "s"), "--port", "0", "--check"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "warning" in done.stderr and "CKPTD_MIN_FREE_BYTES" in done.stderr, done.stderr
    assert "every save will be refused" in done.stderr, done.stderr
    del env["CKPTD_MIN_FREE_BYTES"]
    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--store",
                           str(tmp_path / "t"), "--port", "0", "--check"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr


def test_a_checkpointers_local_rank_argument_picks_its_port_too(
        monkeypatch: pytest.MonkeyPatch, server: Any, shm: Path) -> None:
    """(Found by review: under mp.spawn or a launcher of one's own, local_rank= comes
    without LOCAL_RANK in the environment, and every rank took the same port.)"""
    from ckptd.client import Checkpointer

    base = _free_port_pair()
    monkeypatch.setenv("CKPTD_PEER_PORT", str(base))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert knobs.peer_port(1) == base + 1
    with Checkpointer(server.url, "ports", rank=1, world_size=2, local_rank=1,
                      shm_dir=shm) as ckpt:
        assert ckpt.peer_server is not None and ckpt.peer_server.port == base + 1
