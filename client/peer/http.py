"""The peer chunk server's HTTP/1.1: a fixed pool of worker threads, a bounded
queue of accepted connections, and deadlines on every read.

It lives inside the training process, so what a connection may cost is bounded
whoever opens it: at most ``workers`` threads ever (no thread per connection),
at most ``queued`` connections waiting for one (more are closed at once), a
request head must arrive whole within ``head_timeout`` of its first byte (a
slowloris holds a worker for that long, no longer), and a kept-alive connection
is closed after ``idle_timeout`` without a request, or at once when others wait.
Only ``GET`` with no body is spoken: that is all a peer asks."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_HEAD = 16384
YIELD_AFTER_S = 0.05
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 503: "Service Unavailable"}


@dataclass(slots=True)
class PeerRequest:
    """One request on a connection, and how to answer it."""

    conn: socket.socket
    method: str
    path: str
    headers: dict[str, str]
    write_timeout: float
    answered: bool = False

    def send(self, status: int, headers: Mapping[str, str], body: bytes | memoryview) -> None:
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        self.conn.settimeout(self.write_timeout)
        self.conn.sendall(data)
        if len(body):
            self.conn.sendall(body)
        self.answered = True

    def json(self, status: int, doc: dict[str, Any], headers: Mapping[str, str] = {}) -> None:
        self.send(status, {"Content-Type": "application/json", **headers},
                  json.dumps(doc).encode())


Handler = Callable[[PeerRequest], None]


class BoundedHTTPServer:
    """Accepts on ``address`` and runs ``handler`` for each request on a worker."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: Handler,
        *,
        workers: int = 8,
        queued: int = 64,
        head_timeout: float = 5.0,
        idle_timeout: float = 5.0,
        write_timeout: float = 30.0,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address, family=family, backlog=128)
        self.socket.settimeout(0.2)  # the accept loop looks at the stop flag this often
        self.server_address = self.socket.getsockname()
        self.handler = handler
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.on_refused = on_refused
        self._queue: queue.Queue[socket.socket | None] = queue.Queue(maxsize=queued)
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, name="ckptd-peer-accept",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"ckptd-peer-{n}",
                                           daemon=True) for n in range(max(1, workers))]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stops accepting, closes every connection, and joins the threads."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self.socket.close()
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        while True:  # connections still queued: closed, not served
            try:
                waiting = self._queue.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                self._forget(waiting)
        for _ in self._threads[1:]:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5.0)

    def _forget(self, conn: socket.socket) -> None:
        with self._open_lock:
            self._open.discard(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.socket.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # out of descriptors: let workers free some
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._open_lock:
                self._open.add(conn)
            try:
                self._queue.put_nowait(conn)
            except queue.Full:
                if self.on_refused is not None:
                    self.on_refused()
                self._forget(conn)  # busy: the client tries another source

    def _work(self) -> None:
        while True:
            conn = self._queue.get()
            if conn is None or self._stop.is_set():
                if conn is not None:
                    self._forget(conn)
                return
            try:
                self._serve(conn)
            except Exception:  # one broken connection must not stop a worker
                log.debug("peer connection failed", exc_info=True)
            finally:
                self._forget(conn)

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        first = True
        while not self._stop.is_set():
            # A new connection gets the head timeout for its first request; a
            # kept-alive one waits idle_timeout for the next, or while others wait
            # only a moment (a restoring peer asks again at once; an idle one yields).
            wait = self.head_timeout if first else (
                self.idle_timeout if self._queue.empty() else YIELD_AFTER_S)
            head = self._read_head(conn, buf, wait)
            if head is None:
                return
            first = False
            request = self._parse(conn, head)
            if request is None:
                return
            self.handler(request)
            if request.headers.get("connection", "").lower() == "close":
                return

    def _read_head(self, conn: socket.socket, buf: bytearray, wait: float) -> bytes | None:
        """The next request head (without its blank line), or None: closed, or a
        head that did not arrive within ``head_timeout`` of its first byte."""
        deadline = None
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(buf[:end])
                del buf[: end + 4]
                return head
            if len(buf) > MAX_HEAD:
                return None
            now = time.monotonic()
            if buf and deadline is None:
                deadline = now + self.head_timeout
            left = wait if deadline is None else deadline - now
            if left <= 0:
                return None
            conn.settimeout(left)
            try:
                data = conn.recv(65536)
            except (TimeoutError, OSError):
                return None
            if not data:
                return None
            buf += data
            if deadline is None:
                deadline = time.monotonic() + self.head_timeout

    def _parse(self, conn: socket.socket, head: bytes) -> PeerRequest | None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        request = PeerRequest(conn, "", "", {}, self.write_timeout)
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            with contextlib.suppress(OSError):
                request.json(400, {"code": "invalid_request", "message": "not HTTP/1.x"},
                             {"Connection": "close"})
            return None
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                request.headers[key.strip().lower()] = value.strip()
        request.method, request.path = parts[0], parts[1]
        if parts[2] == "HTTP/1.0":
            request.headers.setdefault("connection", "close")
        if request.method != "GET" or request.headers.get("content-length", "0") != "0" or (
            "transfer-encoding" in request.headers
        ):
            with contextlib.suppress(OSError):
                request.json(405, {"code": "invalid_request",
                                   "message": "a peer answers GET without a body"},
                             {"Connection": "close", "Allow": "GET"})
            return None
        return request
