"""Shared fixtures: a real ``ckptd serve`` process on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A ``ckptd serve`` child process; ``restart()`` keeps its store and port."""

    store: Path
    token: str | None = None
    extra_args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.port = self.port or free_port()
        args = [sys.executable, "-m", "ckptd", "serve", "--store", str(self.store),
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]
        env = dict(os.environ)
        env.pop("CKPTD_TOKEN", None)
        if self.token:
            env["CKPTD_TOKEN"] = self.token
        self.log_path = self.store.parent / f"server-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptd serve exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"ckptd serve did not answer within {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A fresh server on an empty local store, no token."""
    srv = ServerProcess(store=tmp_path / "store")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A fresh server that requires a bearer token."""
    srv = ServerProcess(store=tmp_path / "store", token="s3cret-token")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A private staging root in shared memory (on disk where there is none)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = Path(tempfile.mkdtemp(prefix="ckptd-test-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
