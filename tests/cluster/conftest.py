"""Replicas of ``ckptd serve`` over one store: moto's S3 server in its own process,
and replica processes on 127.0.0.1 that a test starts, kills and restarts."""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import PortTaken, ServerProcess, free_port
from tests.moto_server import moto_server, s3_env

__all__ = ["PortTaken"]  # (the replica tests catch it)

pytest.importorskip("moto.server")
pytest.importorskip("aiobotocore")

BUCKET = "ckptd-cluster"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 in a child process, with one bucket."""
    with moto_server("tests.cluster.moto_s3", BUCKET, s3_env(),
                     tmp_path_factory.mktemp("moto")) as url:
        yield url


class Replica(ServerProcess):
    """One ``ckptd serve`` process of a cluster, with nothing of the user's AWS or
    ckptd settings in its environment."""

    log_prefix = "replica"

    def __init__(self, store: str, workdir: Path, args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(store=store, extra_args=list(args or []), env=dict(env or {}),
                         log_dir=workdir, port=free_port())  # (its url is known before start)

    @property
    def args(self) -> list[str]:
        return self.extra_args

    @args.setter
    def args(self, value: list[str]) -> None:
        self.extra_args = list(value)

    access_log = False  # (set before start: which requests it answered, in its log)

    def command(self) -> list[str]:
        return [*super().command(), "--access-log" if self.access_log else "--no-access-log"]

    def base_env(self) -> dict[str, str]:
        return s3_env()

    def start(self, timeout: float = 90.0) -> Replica:  # type: ignore[override]
        for _ in range(3):
            try:
                super().start(timeout)
                return self
            except PortTaken:
                self.port = free_port()
        raise AssertionError(f"no free port for a replica:\n{self.log()}")

    def wait_ready(self, timeout: float = 90.0) -> None:
        super().wait_ready(timeout)

    def cluster(self) -> dict[str, object]:
        doc: dict[str, object] = httpx.get(f"{self.url}/v1/cluster", timeout=5.0).json()
        return doc

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@dataclass
class Cluster:
    """Replicas over one store; ``add`` starts one more."""

    store: str
    workdir: Path
    mode_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    replicas: list[Replica] = field(default_factory=list)

    def add(self, *, start: bool = True) -> Replica:
        replica = Replica(self.store, self.workdir, list(self.mode_args), dict(self.env))
        self.replicas.append(replica)
        if start:
            replica.start()
        return replica

    @property
    def urls(self) -> str:
        return ",".join(r.url for r in self.replicas)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


@pytest.fixture
def s3_store(moto_endpoint: str) -> str:
    """A fresh prefix of the moto bucket, as a store URL."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex}?endpoint={moto_endpoint}"


@pytest.fixture
def lease_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Replicas over one shared directory that find each other by store leases."""
    cluster = Cluster(str(tmp_path / "store"), tmp_path, ["--member-leases"],
                      {"CKPTD_MEMBER_TTL": "1.5", "CKPTD_HEARTBEAT_INTERVAL": "0.5"})
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def static_pair(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas over one directory store that list each other (``--peers``),
    started; one a test stopped (SIGSTOP) is let go on before both are stopped."""
    a = Replica(str(tmp_path / "store"), tmp_path)
    b = Replica(str(tmp_path / "store"), tmp_path)
    for r in (a, b):
        r.args = ["--peers", f"{a.url},{b.url}"]
    try:
        a.start(), b.start()
        yield a, b
    finally:
        for r in (a, b):
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGCONT)
            r.stop()
