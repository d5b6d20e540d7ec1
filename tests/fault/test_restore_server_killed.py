"""``kill -9`` of the server in the middle of a restore over HTTP: the restore
fails with ``Unavailable`` naming the server and saying to run it again (what
retrying callers catch), not as chunks lost from every source; the progress bar
of ``ckptd restore --to`` does not end full."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ckptd.client import Checkpointer
from ckptd.client.restore.prefetch import restore_command
from ckptd.errors import RestoreError, Unavailable
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(240)

MIB = 1 << 20
SIZE = 96 * MIB  # the state: big enough that a restore is under way for a while
CHUNK = 256 * 1024


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    monkeypatch.setenv("CKPTD_RETRIES", "1")  # (a dead server: no long retrying)
    server = ServerProcess(store=tmp_path / "store")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def sent_by(pid: int) -> int:
    """Bytes process ``pid`` has written (its sockets included)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar in /proc/{pid}/io")


class Killer:
    """Kills the server with SIGKILL once it has sent ``after`` more bytes (the
    restore is then under way, and far from done)."""

    def __init__(self, server: ServerProcess, after: int) -> None:
        assert server.proc is not None
        self.server, self.proc = server, server.proc
        self.start = sent_by(self.proc.pid)
        self.after = after
        self.killed = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sent_by(self.proc.pid) - self.start >= self.after:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=15)
                self.killed = True
                return
            time.sleep(0.001)

    def join(self) -> None:
        self.thread.join(timeout=30)
        self.server.proc = None


def test_a_server_killed_mid_restore_is_unavailable_not_lost_chunks(
    srv: ServerProcess, tmp_path: Path
) -> None:
    state = {f"w{i}": torch.randn(SIZE // 4 // 8) for i in range(8)}
    with Checkpointer(srv.url, "big", chunk_size=CHUNK, shm_dir=tmp_path / "shm") as ckpt:
        ckpt.save(1, state).wait(timeout=120)

    target = {name: torch.zeros_like(t) for name, t in state.items()}
    with Checkpointer(srv.url, "big", shm_dir=tmp_path / "shm") as ckpt:
        ckpt.latest()  # (the plan's reads are past: what is killed is the chunks')
        killer = Killer(srv, 8 * MIB)
        with pytest.raises((RestoreError, Unavailable)) as info:
            ckpt.restore(target, tiers=["store"])
        killer.join()
    assert killer.killed
    err = info.value
    assert isinstance(err, Unavailable), err
    assert srv.url in str(err) and "run the restore again" in str(err), err
    assert err.detail["url"] == srv.url and err.detail["step"] == 1 and err.detail["ids"]

    srv.start()  # (the same store and port)
    console = Console(force_terminal=True, record=True, width=160, color_system=None)
    killer = Killer(srv, 8 * MIB)
    with pytest.raises(Unavailable) as cli:
        restore_command(srv.url, "big", 0, tmp_path / "to", peers=False, console=console)
    killer.join()
    assert killer.killed
    assert srv.url in str(cli.value) and "run the restore again" in str(cli.value)
    text = console.export_text()
    assert "100.7/100.7 MB" not in text, text
    assert "failed:" in text, text


class Stopper(Killer):
    """Stops the server (SIGSTOP: alive, its kernel still acknowledging, nothing
    sent) once it has sent ``after`` more bytes: a hung server, not a dead one."""

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sent_by(self.proc.pid) - self.start >= self.after:
                self.proc.send_signal(signal.SIGSTOP)
                self.killed = True
                return
            time.sleep(0.001)


def test_a_server_that_hangs_mid_restore_fails_it_in_about_one_request_timeout(
    srv: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each chunk went through the transport's retries of a whole request timeout
    # after its batched read timed out: at the default 60 s, hours for a large
    # restore (the CLI printed nothing meanwhile).
    timeout = 4.0
    monkeypatch.setenv("CKPTD_REQUEST_TIMEOUT", str(timeout))
    monkeypatch.setenv("CKPTD_RETRIES", "3")
    state = {f"w{i}": torch.randn(SIZE // 4 // 8) for i in range(8)}
    with Checkpointer(srv.url, "big", chunk_size=CHUNK, shm_dir=tmp_path / "shm") as ckpt:
        ckpt.save(1, state).wait(timeout=120)
    target = {name: torch.zeros_like(t) for name, t in state.items()}
    assert srv.proc is not None
    proc = srv.proc
    try:
        with Checkpointer(srv.url, "big", shm_dir=tmp_path / "shm") as ckpt:
            ckpt.latest()
            stopper = Stopper(srv, 8 * MIB)
            t0 = time.monotonic()
            with pytest.raises(Unavailable) as info:
                ckpt.restore(target, tiers=["store"])
            took = time.monotonic() - t0
            stopper.thread.join(timeout=30)
            assert stopper.killed
            # Woken before the checkpointer closes: its goodbye to a stopped server
            # waited out the request timeout and its retries (~11 s), testing nothing.
            proc.send_signal(signal.SIGCONT)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert took < 4 * timeout, f"{took:.1f} s"  # (one timeout, and room for a slow host)
    assert srv.url in str(info.value) and "stopped answering" in str(info.value)
