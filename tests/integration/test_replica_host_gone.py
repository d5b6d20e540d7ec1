"""A replica whose host vanishes (nothing answers, not even a refusal) costs a save
seconds, not the request timeout: connecting has its own timeout
(``CKPTD_CONNECT_TIMEOUT``), and the calls move to the next replica.

Two ``ckptd serve`` replicas over one directory store; the job's home replica is
SIGKILLed and its port then answers no SYN (a listening socket whose accept queue
is full: the kernel drops new connections' SYNs, as for a host that is gone),
all on 127.0.0.1."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ckptd import knobs
from ckptd.client import Checkpointer
from ckptd.cluster import job_key, rank_members
from tests.conftest import ServerProcess, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOB = "gone"


@pytest.fixture(autouse=True)
def _short_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 s, not the 3 s default (for the clients here and the servers they start):
    each test waits out one connect timeout, and its bound is that timeout, whatever
    it is set to, plus the same slack."""
    monkeypatch.setenv("CKPTD_CONNECT_TIMEOUT", "1")


@contextmanager
def silent_port(port: int) -> Iterator[None]:
    """``127.0.0.1:port`` takes no new connection and refuses none: their SYNs are
    dropped (a full accept queue), as a vanished host's would be."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(0)
        filler = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        try:
            with socket.socket() as probe:  # the queue is full: a connect hangs
                probe.settimeout(0.5)
                with pytest.raises(TimeoutError):
                    probe.connect(("127.0.0.1", port))
            yield
        finally:
            filler.close()


def test_a_replica_whose_host_vanished_costs_a_save_seconds(tmp_path: Path, shm: Path) -> None:
    store = tmp_path / "store"
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [ServerProcess(store=store, port=p, extra_args=["--peers", ",".join(urls)])
                for p in ports]
    for replica in replicas:
        replica.start()
    victim = replicas[urls.index(rank_members(job_key(JOB), urls)[0])]
    state = {"w": torch.arange(64 * 1024, dtype=torch.float32)}
    try:
        # A fixed, long heartbeat interval: no heartbeat may reach the port in the
        # moment between the kill and the silence (a refusal is marked down at once).
        with Checkpointer(",".join(urls), JOB, rank=0, world_size=1, shm_dir=shm,
                          chunk_size=16384, serve_peers=False, heartbeat_interval=600,
                          timeout=120) as ckpt:
            assert ckpt.save(1, state).wait(60).state == "committed"
            victim.stop()  # SIGTERM: its port is free at once, nothing refuses below
            with silent_port(victim.port):
                state["w"] += 1
                t0 = time.perf_counter()
                result = ckpt.save(2, state).wait(120)
                took = time.perf_counter() - t0
                assert result.state == "committed"
                assert ckpt.latest() == 2
            # The job's home was gone: the manifest, the commit and half the chunks
            # went to the next replica after one connect timeout, not 60 s.
            bound = knobs.connect_timeout() + 4.0
            assert took < bound, f"save of step 2 took {took:.1f} s (bound {bound:.1f} s)"
            print(f"\nsave with the job's home replica gone: {took:.2f} s "
                  f"(connect timeout {knobs.connect_timeout():g} s, request timeout "
                  f"{knobs.request_timeout():g} s)")
    finally:
        for replica in replicas:
            replica.stop()


def test_a_peer_or_replica_chunk_read_from_a_vanished_host_costs_a_connect_timeout() -> None:
    """Chunk reads (peers, a replica's chunk route) go through ``PeerClient``, which
    connected with the whole read timeout (60 s for a replica): a restore from a
    vanished host waited that long before its next source."""
    from ckptd.client.peer import PeerClient
    from ckptd.errors import Unavailable

    port = free_port()
    client = PeerClient("t", timeout=60.0)
    try:
        with silent_port(port):
            t0 = time.perf_counter()
            with pytest.raises((Unavailable, OSError)):
                client.fetch_into(f"http://127.0.0.1:{port}", "0" * 64,
                                  memoryview(bytearray(16)))
            took = time.perf_counter() - t0
    finally:
        client.close()
    bound = knobs.connect_timeout() + 2.0
    assert took < bound, f"a read from a silent host took {took:.1f} s (bound {bound:.1f} s)"
