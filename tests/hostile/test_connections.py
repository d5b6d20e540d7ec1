"""The server stays up for everyone (items 1, 3 and 4): half-open connections are
timed out and capped, stalled or refused bodies do not pin memory or get read in
full, and repeated errors do not flood the log. Loopback only, bounded loops."""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ckptd.hashing import chunk_id
from tests.conftest import ServerProcess


class LimitedServer(ServerProcess):
    """A ``ckptd serve`` whose open-file limit (soft and hard) is ``nofile``."""

    nofile: int = 0

    def start(self, timeout: float = 30.0) -> None:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

        real = subprocess.Popen
        subprocess.Popen = functools.partial(real, preexec_fn=limit)  # type: ignore[misc]
        try:
            super().start(timeout)
        finally:
            subprocess.Popen = real  # type: ignore[misc]


def _serve(tmp_path: Path, env: dict[str, str], nofile: int = 0) -> ServerProcess:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        srv: ServerProcess
        if nofile:
            srv = LimitedServer(store=tmp_path / "store")
            srv.nofile = nofile  # type: ignore[attr-defined]
        else:
            srv = ServerProcess(store=tmp_path / "store")
        srv.start()
        return srv
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def slow_client_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = _serve(tmp_path, {"CKPTD_HEADER_TIMEOUT": "2", "CKPTD_BODY_TIMEOUT": "3"}, nofile=256)
    try:
        yield srv
    finally:
        srv.stop()


def _half_open(port: int, n: int) -> list[socket.socket]:
    socks = []
    for i in range(n):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            if i % 2:  # half of them send part of their headers, the rest nothing
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


@pytest.mark.slow
def test_half_open_connections_do_not_lock_out_health_or_saves(
    slow_client_server: ServerProcess,
) -> None:
    srv = slow_client_server
    socks = _half_open(srv.port, 300)
    try:
        t0 = time.monotonic()
        healthy = None
        while time.monotonic() - t0 < 15 and healthy is None:  # bounded
            try:
                r = httpx.get(f"{srv.url}/healthz", timeout=2)
                if r.status_code == 200:
                    healthy = time.monotonic() - t0
            except httpx.HTTPError:
                time.sleep(0.2)
        assert healthy is not None and healthy < 10, healthy
        data = os.urandom(64 * 1024)
        r = httpx.put(f"{srv.url}/v1/chunks/{chunk_id(data)}", content=data, timeout=10)
        assert r.status_code == 201, r.text
        # The server closed the half-open ones (header timeout), not left them hanging.
        closed = 0
        for s in socks[:20]:
            try:
                s.settimeout(5)
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == 20
    finally:
        for s in socks:
            s.close()
    log = srv.log()
    assert log.count("out of system resource") < 20, log.count("out of system resource")
    assert "Traceback" not in log


@pytest.fixture
def budget_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = _serve(tmp_path, {"CKPTD_INGEST_BUDGET": str(32 << 20), "CKPTD_INGEST_WAIT": "1",
                            "CKPTD_BODY_TIMEOUT": "3"})
    try:
        yield srv
    finally:
        srv.stop()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_declared_uploads_share_one_memory_budget(budget_server: ServerProcess) -> None:
    srv = budget_server
    assert srv.proc is not None
    before = _rss(srv.proc.pid)
    socks = []
    try:
        for i in range(30):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            cid = chunk_id(str(i).encode())
            s.sendall(f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Length: {16 << 20}\r\n\r\n".encode() + b"x" * 1024)
            socks.append(s)
        time.sleep(2.0)
        grown = _rss(srv.proc.pid) - before
        assert grown < 150 << 20, f"server grew {grown >> 20} MiB for 30 stalled uploads"
        # Over budget: refused with a coded 503 after the wait, not left pending.
        answers = []
        for s in socks:
            s.settimeout(10)
            try:
                answers.append(s.recv(4096))
            except OSError:
                answers.append(b"")
        assert sum(b" 503 " in a for a in answers) >= 20
        # The stalled ones were timed out (408); they freed the budget.
        assert any(b" 408 " in a for a in answers)
    finally:
        for s in socks:
            s.close()
    data = os.urandom(1 << 20)
    r = httpx.put(f"{srv.url}/v1/chunks/{chunk_id(data)}", content=data, timeout=10)
    assert r.status_code == 201, r.text


def test_a_refused_body_is_not_read(token_server: ServerProcess) -> None:
    s = socket.create_connection(("127.0.0.1", token_server.port), timeout=10)
    s.sendall(f"PUT /v1/chunks/{'a' * 64} HTTP/1.1\r\nHost: x\r\n"
              f"Content-Length: {2 << 30}\r\n\r\n".encode())
    sent = 0
    piece = b"x" * (1 << 16)
    t0 = time.monotonic()
    try:
        while sent < (1 << 30) and time.monotonic() - t0 < 20:  # bounded
            s.sendall(piece)
            sent += len(piece)
    except OSError:
        pass
    finally:
        s.close()
    assert sent < 256 << 20, f"the server read {sent >> 20} MiB of a refused body"


def test_content_length_with_transfer_encoding_is_refused(server: ServerProcess) -> None:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/chunks/missing HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    answer = b""
    while chunk := s.recv(4096):
        answer += chunk
    s.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]


def test_without_httptools_the_server_says_what_it_cannot_guard(tmp_path: Path) -> None:
    # httptools hidden from the server's look-up, as in an install without it.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.util as u\n"
        "_real = u.find_spec\n"
        "u.find_spec = lambda name, package=None: (\n"
        "    None if name == 'httptools' else _real(name, package))\n")
    srv = ServerProcess(store=tmp_path / "store",
                        env={"PYTHONPATH": os.pathsep.join(
                            p for p in (str(site), os.environ.get("PYTHONPATH")) if p)})
    srv.start()
    try:
        assert httpx.get(f"{srv.url}/healthz", timeout=10).status_code == 200
    finally:
        srv.stop()
    warning = [line for line in srv.log().splitlines() if "httptools is not installed" in line]
    assert warning, srv.log()
    assert "CKPTD_HEADER_TIMEOUT" in warning[0] and "CKPTD_MAX_CONNECTIONS" in warning[0]


class Flood(threading.Thread):
    """Keeps ``n`` half-open connections to ``port`` (half with part of a request
    head, half with nothing), each reopened at once when the server closes it;
    stops by itself after ``seconds``."""

    def __init__(self, port: int, n: int, seconds: float) -> None:
        super().__init__(daemon=True)
        self.port, self.n, self.seconds = port, n, seconds
        self.stop = threading.Event()
        self.opened = 0
        self.reopened = 0

    def _open(self, i: int) -> socket.socket | None:
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", self.port))
            if i % 2:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        self.opened += 1
        return s

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        socks: list[socket.socket | None] = [self._open(i) for i in range(self.n)]
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:  # bounded
                for i, s in enumerate(socks):
                    if s is not None:
                        try:
                            if s.recv(4096) != b"":
                                continue  # an answer (a 503): closed next time round
                        except BlockingIOError:
                            continue  # still open, still waiting
                        except OSError:
                            pass
                        s.close()
                    socks[i] = self._open(i)
                    self.reopened += 1
                time.sleep(0.01)
        finally:
            for s in socks:
                if s is not None:
                    s.close()


@pytest.fixture
def capped_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """``ulimit -n 256`` (a cap of 192 connections), a token, and a header timeout
    longer than the test: only admission can let anyone in."""
    saved = os.environ.get("CKPTD_HEADER_TIMEOUT")
    os.environ["CKPTD_HEADER_TIMEOUT"] = "120"
    try:
        srv = LimitedServer(store=tmp_path / "store", token="admit-me")
        srv.nofile = 256  # type: ignore[attr-defined]
        srv.start()
    finally:
        if saved is None:
            os.environ.pop("CKPTD_HEADER_TIMEOUT", None)
        else:
            os.environ["CKPTD_HEADER_TIMEOUT"] = saved
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_flood_that_reconnects_at_once_locks_out_neither_health_nor_saves(
    capped_server: ServerProcess,
) -> None:
    import torch

    from ckptd.client import Checkpointer

    srv = capped_server
    flood = Flood(srv.port, 300, seconds=90)
    flood.start()
    try:
        for _ in range(200):  # bounded: until the flood holds its connections
            if flood.opened >= 300:
                break
            time.sleep(0.05)
        time.sleep(1.0)
        # /healthz answers, each time, within its timeout.
        for _ in range(5):
            r = httpx.get(f"{srv.url}/healthz", timeout=5)
            assert r.status_code == 200, r.text
        # An authorized save commits.
        state = {"w": torch.arange(300_000, dtype=torch.float32)}
        with Checkpointer(srv.url, "admitted", token="admit-me", chunk_size=1 << 18) as ckpt:
            result = ckpt.save(1, state).wait(timeout=60)
        assert result.state == "committed", result
        assert flood.is_alive() and flood.reopened > 0, "the flood stopped: nothing was tested"
    finally:
        flood.stop.set()
        flood.join(30)
    log = srv.log()
    assert "Traceback" not in log
    assert log.count("out of system resource") < 20, log.count("out of system resource")


@pytest.fixture
def ten_connections(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = _serve(tmp_path, {"CKPTD_MAX_CONNECTIONS": "10", "CKPTD_HEADER_TIMEOUT": "120"})
    try:
        yield srv
    finally:
        srv.stop()


def _closed(s: socket.socket, wait: float = 5.0) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_admission_closes_the_longest_waiting_connections_never_a_request_under_way(
    ten_connections: ServerProcess,
) -> None:
    srv = ten_connections
    bodies = [os.urandom(1 << 20) for _ in range(3)]
    busy, waiting, newer = [], [], []
    try:
        for body in bodies:  # uploads under way: head and half the body sent
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(f"PUT /v1/chunks/{chunk_id(body)} HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
            busy.append(s)
        time.sleep(0.3)
        for _ in range(7):  # at the cap now
            waiting.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            time.sleep(0.02)  # (an order the server sees)
        time.sleep(0.3)
        for _ in range(9):  # each admitted by closing the one waiting longest
            newer.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            time.sleep(0.02)
        assert all(_closed(s) for s in waiting)
        # Each given 0.5 s to be closed, all in the same 0.5 s (one after another, the
        # seven left open took 3.5 s).
        with ThreadPoolExecutor(len(newer)) as pool:
            closed = list(pool.map(lambda s: _closed(s, 0.5), newer))
        assert closed == [True, True] + [False] * 7
        for s, body in zip(busy, bodies, strict=True):  # untouched: they finish
            s.sendall(body[len(body) // 2:])
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.1 201 "), body[:0]
    finally:
        for s in busy + waiting + newer:
            s.close()


def test_when_every_connection_is_under_way_a_new_one_gets_a_coded_503(
    ten_connections: ServerProcess,
) -> None:
    srv = ten_connections
    busy = []
    try:
        for i in range(10):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(f"PUT /v1/chunks/{chunk_id(str(i).encode())} HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Length: {1 << 20}\r\n\r\n".encode() + b"x" * 1000)
            busy.append(s)
        time.sleep(0.5)
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        busy.append(s)
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"unavailable"' in answer, answer
    finally:
        for s in busy:
            s.close()


def _server_sockets(srv: ServerProcess) -> int:
    """The sockets the server process holds open (its listener included)."""
    assert srv.proc is not None
    fds = Path(f"/proc/{srv.proc.pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(fd).startswith("socket:")
    return count


def _stalled_reader(port: int, cid: str, rcvbuf: int = 4096) -> socket.socket:
    """A connection that asks for a chunk (of more than the sockets' buffers hold)
    and does not read its answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


@pytest.fixture
def ten_quick_senders(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = _serve(tmp_path, {"CKPTD_MAX_CONNECTIONS": "10", "CKPTD_HEADER_TIMEOUT": "120",
                            "CKPTD_BODY_TIMEOUT": "2"})
    try:
        yield srv
    finally:
        srv.stop()


def test_readers_that_take_nothing_hold_no_more_than_the_cap_and_are_closed(
    ten_quick_senders: ServerProcess,
) -> None:
    # An answer still in the server's buffers is a request under way: admission
    # closing it gracefully freed nothing (the close waits for the reader), so
    # stalled readers piled up past the cap, and nothing ever closed them.
    srv = ten_quick_senders
    data = os.urandom(16 << 20)
    cid = chunk_id(data)
    assert httpx.put(f"{srv.url}/v1/chunks/{cid}", content=data, timeout=30).status_code == 201
    baseline = _server_sockets(srv)
    readers = []
    try:
        for _ in range(30):
            readers.append(_stalled_reader(srv.port, cid))
            time.sleep(0.02)
        time.sleep(0.5)
        assert _server_sockets(srv) <= baseline + 10, _server_sockets(srv)
        # A reader that took nothing for CKPTD_BODY_TIMEOUT (2 s) is closed.
        for _ in range(100):  # bounded: 10 s
            if _server_sockets(srv) <= baseline:
                break
            time.sleep(0.1)
        assert _server_sockets(srv) <= baseline, _server_sockets(srv)
        assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200
    finally:
        for s in readers:
            s.close()
    assert "Traceback" not in srv.log()


def test_a_request_pipelined_behind_an_answer_being_sent_is_not_closed_by_admission(
    ten_connections: ServerProcess,
) -> None:
    srv = ten_connections
    data = os.urandom(16 << 20)
    cid = chunk_id(data)
    assert httpx.put(f"{srv.url}/v1/chunks/{cid}", content=data, timeout=30).status_code == 201
    others = []
    a = _stalled_reader(srv.port, cid, rcvbuf=1 << 16)  # (read at the end)
    try:
        # The next request's head begins behind the answer, not yet read.
        a.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        for _ in range(10):  # 9 fill the cap; the 10th closes the one waiting longest
            others.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            time.sleep(0.05)
        time.sleep(0.3)
        a.sendall(b"\r\n")
        got = b""
        a.settimeout(10)
        while got.count(b"HTTP/1.1 200 ") < 2 or not got.endswith(b"}"):  # bounded by recv
            piece = a.recv(1 << 20)
            if not piece:
                break
            got += piece
        assert got.count(b"HTTP/1.1 200 ") == 2 and data in got, got[-300:]
        assert _closed(others[0])  # the one that waited longest went instead
    finally:
        for s in [a, *others]:
            s.close()


@pytest.fixture
def full_budget_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = _serve(tmp_path, {"CKPTD_INGEST_BUDGET": str(16 << 20), "CKPTD_INGEST_WAIT": "6",
                            "CKPTD_BODY_TIMEOUT": "20"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_an_upload_pipelined_behind_another_request_reads_nothing_before_its_budget(
    full_budget_server: ServerProcess,
) -> None:
    # An upload's body is read once it holds its share of CKPTD_INGEST_BUDGET. One
    # pipelined behind another request was read up to 1 MiB before that (uvicorn
    # resumes reading when the request before it is answered), outside the budget.
    srv = full_budget_server
    assert srv.proc is not None
    holder = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    holder.sendall(f"PUT /v1/chunks/{'b' * 64} HTTP/1.1\r\nHost: x\r\n"
                   f"Content-Length: {16 << 20}\r\n\r\n".encode())  # the whole budget
    time.sleep(0.5)
    before = _rss(srv.proc.pid)
    socks = []
    body = b"x" * (1200 << 10)
    try:
        for i in range(60):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.setblocking(False)
            head = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                    + f"PUT /v1/chunks/{chunk_id(str(i).encode())} HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Length: {16 << 20}\r\n\r\n".encode())
            s.send(head)
            socks.append([s, memoryview(body)])
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # bounded: send what the server takes
            for pending in socks:
                s, rest = pending
                if rest:
                    with contextlib.suppress(BlockingIOError):
                        pending[1] = rest[s.send(rest):]
            time.sleep(0.01)
        grown = _rss(srv.proc.pid) - before
        assert grown < 30 << 20, f"the server read {grown >> 20} MiB of waiting uploads"
    finally:
        for s, _ in socks:
            s.close()
        holder.close()


def test_an_idle_kept_alive_connection_outlives_a_clients_pool_expiry(
        server: ServerProcess) -> None:
    """Clients keep an idle connection pooled for 5 s (httpx's default): the server
    keeps it longer, so a request on it is never met by the server's close (which a
    routing client took for a replica down)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/healthz")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        sock = conn.sock
        time.sleep(5.5)
        conn.request("GET", "/healthz")
        assert conn.sock is sock  # (the same connection, not a new one)
        again = conn.getresponse()
        again.read()
        assert again.status == 200
    finally:
        conn.close()
