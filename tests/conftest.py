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
from typing import Any

# Imported here, at collection: hypothesis's pytest plugin imports it at the end
# of a session that ran none of its tests, from deep in pytest's hooks, where
# CPython 3.11.7's parser (under pytest's assertion rewriting) fails with
# "SystemError: AST constructor recursion depth mismatch" and the run exits 1.
import hypothesis  # noqa: F401
import pytest


def _one_default_tls_context() -> None:
    """The tests' ``httpx.get(...)`` calls (a poll every 50 ms, in places) each
    build a client, and each client its default TLS context: certifi's whole bundle
    read, ~40 ms of CPU, even for http:// (the suite's CPU is its wall time on two
    cores). Here the default context is built once per trust setting and shared,
    as ``client/transport_http.tls_verify`` does in ckptd itself; any other
    ``verify=`` (a test's own CA, an SSLContext, False) is built as httpx builds it."""
    import functools

    import httpx._transports.default as transports

    build = getattr(transports, "create_ssl_context")  # noqa: B009 (not re-exported)

    @functools.lru_cache(maxsize=4)
    def default(cafile: str | None, capath: str | None) -> Any:
        return build(verify=True)

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is True and cert is None and trust_env:
            return default(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    setattr(transports, "create_ssl_context", create_ssl_context)  # noqa: B010


_one_default_tls_context()


def pytest_configure(config: pytest.Config) -> None:
    """Once per run (not in each xdist worker): ckptd's modules compiled to
    ``__pycache__`` before any process imports them. Where the environment sets
    PYTHONDONTWRITEBYTECODE (this VM's does), Python writes no bytecode and every
    process compiled ckptd's ~80 modules from source again: ~0.2 s of a ~1.2 s
    ``ckptd serve`` start, less in a CLI command, over ~1,000 processes of a run
    (its CPU is its wall time on two cores). Existing bytecode is still read, and a
    source changed since is compiled afresh, as Python always does."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in ("ckptd", "client", "server", "tests"):
        compileall.compile_dir(root / folder, quiet=2)


@pytest.fixture(scope="session", autouse=True)
def _worker_shm() -> Iterator[None]:
    """Under pytest-xdist, each worker stages in a shared-memory root of its own
    (``CKPTD_SHM_DIR``, inherited by the servers and ranks it starts): tests on
    several workers name the same jobs, and one pool per job and rank is the
    design, so two workers would otherwise meet in ``/dev/shm/ckptd-<uid>/<job>``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or "CKPTD_SHM_DIR" in os.environ:
        yield
        return
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix=f"ckptd-test-{worker}-", dir=base))
    os.environ["CKPTD_SHM_DIR"] = str(root)
    try:
        yield
    finally:
        os.environ.pop("CKPTD_SHM_DIR", None)
        shutil.rmtree(root, ignore_errors=True)


_PORT_SLICE = 2000  # ports per pytest process (an xdist worker, or a plain run)
_ports: Iterator[int] | None = None


def _port_candidates() -> Iterator[int]:
    """This process's own slice of ports below the kernel's ephemeral range: a port
    picked by binding port 0 comes from that range, which every outgoing connection
    of the suite (thousands) draws its local port from too, so between the pick and
    a server's bind a connection could take it (a server that then cannot bind, or
    a script that gives up). Below the range, and one slice per xdist worker, no
    connection and no other worker picks it. Starts at a random place in the slice
    (a port of a run just before may still be in TIME_WAIT) and goes round."""
    import contextlib
    import itertools
    import random

    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    slices = max(0, (low - 12000) // _PORT_SLICE)
    if not slices:  # no room below the ephemeral range: the kernel's pick
        while True:
            yield 0
    first = 12000 + (index % slices) * _PORT_SLICE
    start = random.randrange(_PORT_SLICE)
    for offset in itertools.cycle(range(_PORT_SLICE)):
        yield first + (start + offset) % _PORT_SLICE


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on or holds now, from this test
    process's own slice (see ``_port_candidates``)."""
    global _ports
    if _ports is None:
        _ports = _port_candidates()
    for _ in range(_PORT_SLICE):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", next(_ports)))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port in this test process's slice")


def healthy(port: int) -> bool:
    """Whether 127.0.0.1:``port`` answers ``GET /healthz`` with a 200 (plain
    http.client: a poll that costs no client of its own)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port`` (Linux:
    the listening socket's inode in /proc/net/tcp among the process's descriptors)."""
    inodes = set()
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) in inodes for fd in fds.iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return False  # (it exited, or closed a descriptor while read: poll again)


class PortTaken(RuntimeError):
    """The port picked for a server was taken before it could bind it."""


@dataclass
class ServerProcess:
    """A ``ckptd serve`` child process; ``restart()`` keeps its store and port. A
    port it picked itself and lost to another process before binding is picked
    again (at most three times)."""

    store: Path | str
    token: str | None = None
    extra_args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # over base_env()
    log_dir: Path | None = None  # default: beside a directory store

    log_prefix = "server"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "ckptd", "serve", "--store", str(self.store),
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("CKPTD_TOKEN", None)
        return env

    def start(self, timeout: float = 30.0) -> None:
        picked = not self.port
        for _ in range(3):
            self.port = self.port or free_port()
            self.popen()
            try:
                self.wait_ready(timeout)
                return
            except PortTaken:
                if not picked:
                    raise
                self.port = 0
        raise RuntimeError(f"no free port for ckptd serve:\n{self.log()}")

    def popen(self) -> None:
        env = {**self.base_env(), **self.env}
        if self.token:
            env["CKPTD_TOKEN"] = self.token
        folder = self.log_dir or Path(self.store).parent
        self.log_path = folder / f"{self.log_prefix}-{self.port}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = self.log()
                if "address already in use" in log.lower():
                    raise PortTaken(log)
                raise RuntimeError(f"ckptd serve exited early:\n{log}")
            # (the answer must be this process's: another test's server may have
            # bound the port this one picked, while this one still starts)
            if healthy(self.port) and listens(self.proc.pid, self.port):
                return
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
        path = self.log_path
        return path.read_text(errors="replace") if path is not None and path.exists() else ""

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


# The README's test command runs the suite on pytest-xdist workers: the tests
# that start many processes (multi-node scenarios, torchrun jobs, replica clusters:
# marked ``heavy`` here, ``-m heavy`` selects them) one after another in two lanes,
# the rest (which mostly wait on a server) test by test on the workers free. The
# multi-node scenarios and torchrun jobs share one lane: each takes both cores of
# the CI machine for a while, and its bounds (seconds between steps, a snapshot
# within so long) are about ckptd, not about a machine shared with another such
# run. The replica clusters (bound by one moto process, with no such bounds) take
# the other: in the one lane they made it the suite's critical path (~21 of its 23
# minutes on the 2-core VM, the other workers idle for its last minutes).
#
# It names four workers, the fourth held back while a lane still runs: then three
# tests at a time (a fourth beside a lane made the load-bound tests slower, and two of
# them failed); once the lanes are done, four of the rest at a time, which mostly
# wait on servers (three of them kept only 1.2-1.5 of the two cores busy for the last
# third of the run).
_HEAVY = ("multinode", "e2e", "cluster")
_LANES = {"cluster": "replicas"}  # heavy folder -> its own lane (else "heavy")
_BUILD_ONCE = ("tests/integration/test_install.py",)
_BESIDE_LANES = 3  # workers that run tests while a lane runs (the rest wait)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(g in Path(str(item.fspath)).parts[-3:-1] for g in _HEAVY):
            item.add_marker(pytest.mark.heavy)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist, the heavy tests go to their lanes, one after another in
    each, while the other workers take the rest test by test, the install tests
    together (for their one environment). xdist's own ``loadgroup`` does not group
    under this pytest: it renames items, which pytest 9 no longer reads. (xdist
    hands out the largest scopes first: both lanes start at once.)"""
    from xdist.scheduler import LoadScopeScheduling

    lanes = {"heavy", *_LANES.values()}

    class HeavyApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            for g in _HEAVY:
                if f"tests/{g}/" in path:
                    return _LANES.get(g, "heavy")
            # A module whose fixture builds a fresh environment once for its tests:
            # split test by test, two workers each built it (~100 s each).
            return path if path in _BUILD_ONCE else nodeid

        def _held(self, node: Any) -> bool:
            """The fourth worker (and any after it) waits while a lane runs."""
            if list(self.assigned_work).index(node) < _BESIDE_LANES:
                return False
            return any(scope in lanes for scope in self.workqueue) or any(
                scope in lanes and not all(unit.values())
                for work in self.assigned_work.values() for scope, unit in work.items())

        def _assign_work_unit(self, node: Any) -> None:
            if not self._held(node):
                super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            if not self._held(node):
                super()._reschedule(node)

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            # A lane's end lets the held in, with two tests: a worker runs the last it
            # was sent only once it has the next (or is told there is none).
            for other in list(self.assigned_work):
                for _ in range(2):
                    if (other is node or other.shutting_down
                            or self._pending_of(self.assigned_work[other]) >= 2):
                        break
                    self._reschedule(other)

    return HeavyApart(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """With CKPTD_TEST_CPU_REPORT=FILE, each test's CPU seconds (this process's, and
    its reaped children's: the servers, CLI commands and torchrun jobs it started) are
    appended to FILE, one tab-separated line per test (then its start and end, epoch
    seconds, and its xdist worker): the suite's wall time on CI's
    two cores is its CPU, and this says where it goes (docs/development.md)."""
    report = os.environ.get("CKPTD_TEST_CPU_REPORT")
    if not report:
        return (yield)
    import resource

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    own, children = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    began = time.time()
    try:
        return (yield)
    finally:
        own, children = cpu(resource.RUSAGE_SELF) - own, cpu(resource.RUSAGE_CHILDREN) - children
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        with open(report, "a") as out:
            out.write(f"{own + children:.2f}\t{own:.2f}\t{children:.2f}\t{item.nodeid}"
                      f"\t{began:.2f}\t{time.time():.2f}\t{worker}\n")
