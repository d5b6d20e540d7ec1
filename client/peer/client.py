"""``PeerClient``: fetches a chunk from a peer straight into the caller's buffer
over kept-alive blocking sockets, with typed errors (it does not hash: the
restore engine verifies every chunk)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Mapping
from urllib.parse import urlparse

from ckptd import knobs
from ckptd.errors import (
    ChunkNotFound,
    ChunkSizeMismatch,
    CkptdError,
    Conflict,
    InvalidRequest,
    Unavailable,
    from_json,
)

log = logging.getLogger(__name__)


def _peer_address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
        raise InvalidRequest(f"peer URL {url!r} is not http://host:port")
    return parsed.hostname, parsed.port


class _Conn:
    """One kept-alive connection to a peer: a blocking socket (so that a body can
    be read with ``MSG_WAITALL``, one system call per chunk) whose send and receive
    timeouts are set in the kernel."""

    __slots__ = ("sock", "url")

    def __init__(self, url: str, timeout: float) -> None:
        host, port = _peer_address(url)
        self.url = url
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(None)  # blocking: MSG_WAITALL then waits for the whole body
        sec = int(timeout)
        tv = struct.pack("ll", sec, int((timeout - sec) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class PeerClient:
    """Fetches chunks from peers into caller buffers over kept-alive connections.
    Thread-safe: each call takes its own connection from a per-peer pool.

    It speaks just enough HTTP/1.1 for a ``PeerServer`` (a GET, a status line,
    headers, a ``Content-Length`` body), on blocking sockets: the body is read
    straight into the caller's buffer with ``MSG_WAITALL`` (about half the CPU of
    ``http.client``'s reads, and a third of httpx's)."""

    def __init__(
        self, token: str | None = None, *, timeout: float | None = None, idle_per_peer: int = 8,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.timeout = knobs.peer_timeout() if timeout is None else timeout
        # ``headers``: sent with every request (a ckptd server's chunk route reads the
        # same way, given its bearer token and the job a scoped token acts for).
        lines = [f"{k}: {v}\r\n" for k, v in (headers or {}).items()]
        if token:
            lines.append(f"Authorization: Bearer {token}\r\n")
        if any("\r" in line[:-2] or "\n" in line[:-2] for line in lines):
            raise InvalidRequest("a header of a chunk request holds a line break")
        self._auth = "".join(lines)
        self._idle: dict[str, list[_Conn]] = {}
        self._idle_per_peer = idle_per_peer
        self._lock = threading.Lock()
        self._closed = False

    def _take(self, url: str) -> tuple[_Conn, bool]:
        with self._lock:
            idle = self._idle.get(url)
            if idle:
                return idle.pop(), True
        return _Conn(url, self.timeout), False

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(conn.url, [])
            if not self._closed and len(idle) < self._idle_per_peer:
                idle.append(conn)
                return
        conn.close()

    def fetch_into(self, url: str, cid: str, dest: memoryview) -> int:
        """Reads chunk ``cid`` from the peer at ``url`` into ``dest`` (which must be
        exactly the chunk's length); returns the bytes read. Unverified."""
        for attempt in range(2):
            try:
                # The retry takes a fresh connection: another idle one may be closed too.
                conn, reused = self._take(url) if attempt == 0 else (
                    _Conn(url, self.timeout), False)
            except OSError as exc:
                reason = "unreachable" if isinstance(exc, ConnectionRefusedError) else "failed"
                if isinstance(exc, TimeoutError):
                    reason = "timeout"
                raise Unavailable(f"peer {url}: {type(exc).__name__}: {exc}", peer=url,
                                  reason=reason) from exc
            try:
                return self._fetch(conn, url, cid, dest)
            except CkptdError:
                raise  # an answer (the connection was returned or closed already)
            except (_Disconnected, BrokenPipeError, ConnectionResetError) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the peer closed an idle connection: once more, fresh
                raise Unavailable(f"peer {url} dropped the connection: {exc}", peer=url,
                                  reason="disconnected") from exc
            except (BlockingIOError, TimeoutError) as exc:
                conn.close()
                raise Unavailable(f"peer {url} timed out after {self.timeout} s", peer=url,
                                  reason="timeout") from exc
            except (OSError, ValueError) as exc:
                conn.close()
                raise Unavailable(f"peer {url}: {type(exc).__name__}: {exc}", peer=url,
                                  reason="failed") from exc
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _fetch(self, conn: _Conn, url: str, cid: str, dest: memoryview) -> int:
        sock = conn.sock
        sock.sendall(f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: peer\r\n{self._auth}\r\n"
                     .encode("ascii"))
        head = bytearray()
        scratch = bytearray(16384)
        end = -1
        while end < 0:
            k = sock.recv_into(scratch)
            if not k:
                raise _Disconnected("connection closed before the answer")
            head += memoryview(scratch)[:k]
            end = head.find(b"\r\n\r\n", max(0, len(head) - k - 3))
            if end < 0 and len(head) > 65536:
                raise ValueError("answer headers longer than 64 KiB")
        status, headers = _parse_head(bytes(head[:end]))
        extra = memoryview(head)[end + 4 :]
        length = headers.get("content-length", "")
        n = int(length) if length.isdigit() else -1
        keep = headers.get("connection", "").lower() != "close"
        if status != 200:
            body = bytearray(extra)
            if n > len(body):
                more = bytearray(min(n, 1 << 20) - len(body))
                got = sock.recv_into(more, len(more), socket.MSG_WAITALL) if more else 0
                body += more[:got]
            if keep and n >= 0 and len(body) == n:
                self._give(conn)
            else:
                conn.close()
            raise _error(status, bytes(body), url, cid)
        if n != len(dest) or len(extra) > n:
            conn.close()
            raise ChunkSizeMismatch(
                f"peer {url} sent {n} bytes for chunk {cid}, expected {len(dest)}",
                id=cid, peer=url,
            )
        got = len(extra)
        dest[:got] = extra
        while got < n:
            k = sock.recv_into(dest[got:], n - got, socket.MSG_WAITALL)
            if not k:
                conn.close()
                raise Unavailable(f"peer {url} sent {got} of {n} bytes of chunk {cid}",
                                  peer=url, reason="short")
            got += k
        if keep:
            self._give(conn)
        else:
            conn.close()
        return got

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle = {}
        for conn in conns:
            conn.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Disconnected(ConnectionError):
    """The peer closed the connection before answering."""


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _error(status: int, body: bytes, url: str, cid: str) -> CkptdError:
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("code"), str):
        err = from_json(doc, status)
        err.detail.setdefault("peer", url)
        return err
    if status == 404:
        return ChunkNotFound(f"peer {url} does not hold chunk {cid}", id=cid, peer=url)
    if status == 409:
        return Conflict(f"peer {url}: chunk {cid} is being overwritten", id=cid, peer=url)
    return Unavailable(f"peer {url} answered {status} for chunk {cid}", peer=url,
                       reason="status")


def wait_listening(url: str, timeout: float = 10.0) -> None:
    """Waits until a peer server answers ``/healthz`` (for tests and launchers)."""
    host, port = _peer_address(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection(host, port, timeout=1.0)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                conn.close()
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise Unavailable(f"peer {url} did not answer within {timeout} s", peer=url)
        time.sleep(0.05)
