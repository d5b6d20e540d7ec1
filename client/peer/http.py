"""The peer chunk server's HTTP/1.1: one thread that admits connections and reads
their request heads, a fixed pool of worker threads that answer whole requests,
and deadlines on every read.

It lives inside the training process, so what a connection may cost is bounded
whoever opens it. A connection holds a worker only while its request is
answered: until its head has arrived whole, it waits in the admitting thread's
selector, costing a descriptor and a small buffer. At most ``max_connections``
(a quarter of the open-file limit) are open; one more closes a waiting one to
make room (the longest sending part of a head, else the longest silent, else the
longest idle kept-alive one), so a flood of half-open connections, even one that
reconnects at once, delays a real peer, whose head arrives whole, by a round
trip, not by head timeouts (issue 20, item 5). A request head must arrive whole
within ``head_timeout`` of the connection (or of its first byte), and a
kept-alive connection is closed after ``idle_timeout`` without a request.
Only ``GET`` with no body is spoken: that is all a peer asks."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_HEAD = 16384
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}
# Sent after a body sent straight from memory that may change under it (a pool a
# save overwrites): "1" when the bytes were still valid once the kernel had them.
VALID_TRAILER = "X-Ckptd-Valid"


def send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Sends ``parts`` in order with as few ``sendmsg`` calls as the socket allows:
    each part straight from where it lies (the kernel copies it once)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = sock.sendmsg(views)
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


@dataclass(slots=True)
class PeerRequest:
    """One request on a connection, and how to answer it."""

    conn: socket.socket
    method: str
    path: str
    headers: dict[str, str]
    write_timeout: float
    answered: bool = False
    version: str = "HTTP/1.1"

    def _head(self, status: int, headers: Mapping[str, str]) -> bytes:
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")

    def send(self, status: int, headers: Mapping[str, str], body: bytes | memoryview) -> None:
        self.conn.settimeout(self.write_timeout)
        send_all(self.conn, [self._head(status, {**headers, "Content-Length": str(len(body))}),
                             body])
        self.answered = True

    def wants_trailers(self) -> bool:
        """The client reads trailer fields (``TE: trailers``): a body may then go
        straight from memory that can change, with its validity after it. Only over
        HTTP/1.1: an HTTP/1.0 client knows no chunked body (RFC 9112, 6.1)."""
        return self.version != "HTTP/1.0" and "trailers" in self.headers.get("te", "").lower()

    def send_checked(self, status: int, headers: Mapping[str, str], body: memoryview,
                     still_valid: Callable[[], bool]) -> bool:
        """Sends ``body`` straight from where it lies (no copy of ours), chunked,
        then the trailer ``X-Ckptd-Valid``: whether ``still_valid()`` held once
        the kernel had taken every byte (``sendmsg`` returns only then), so a
        client that reads it never keeps bytes that changed while they were sent.
        Returns that validity."""
        self.conn.settimeout(self.write_timeout)
        head = self._head(status, {**headers, "Transfer-Encoding": "chunked",
                                   "Trailer": VALID_TRAILER})
        send_all(self.conn, [head, f"{len(body):x}\r\n".encode("ascii"), body, b"\r\n"]
                 if len(body) else [head])
        valid = still_valid()
        send_all(self.conn, [f"0\r\n{VALID_TRAILER}: {int(valid)}\r\n\r\n".encode("ascii")])
        self.answered = True
        return valid

    def json(self, status: int, doc: dict[str, Any], headers: Mapping[str, str] = {}) -> None:
        self.send(status, {"Content-Type": "application/json", **headers},
                  json.dumps(doc).encode())


Handler = Callable[[PeerRequest], None]


def connection_budget() -> int:
    """Connections one peer server keeps open at most: a quarter of the process's
    open-file limit (the training process needs the rest, flood or not), 16 to 512.
    A real peer's head arrives whole, so a flood of half-sent heads never closes it
    first (``BoundedHTTPServer._evict``); against silent connections the cap is how
    many newer ones it may arrive behind."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft < 0:  # RLIM_INFINITY
        soft = 1 << 20
    return max(16, min(soft // 4, 512))


@dataclass(slots=True, eq=False)
class _Conn:
    """An open connection and the request head it is sending."""

    sock: socket.socket
    since: float  # accepted, or handed back after its last answer
    served: int = 0  # requests answered on it
    first_byte: float | None = None  # of the head under way
    buf: bytearray = field(default_factory=bytearray)
    # The queue it waits in for its next head (None: with a worker, or closed).
    where: OrderedDict[socket.socket, _Conn] | None = None


class BoundedHTTPServer:
    """Accepts on ``address`` and runs ``handler`` for each request on a worker."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: Handler,
        *,
        workers: int = 8,
        max_connections: int | None = None,
        head_timeout: float = 5.0,
        idle_timeout: float = 5.0,
        write_timeout: float = 30.0,
        on_refused: Callable[[], None] | None = None,
        on_evicted: Callable[[], None] | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address, family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.handler = handler
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.max_connections = max(2, max_connections or connection_budget())
        self.on_refused = on_refused
        self.on_evicted = on_evicted
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._returned: queue.SimpleQueue[_Conn] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[tuple[_Conn, bytes] | None] = queue.SimpleQueue()
        # Connections waiting for a request head, in the selector, each in one of
        # three queues in the order they entered it (which is their deadlines'
        # order): sent nothing yet, sent part of a head, kept alive after a request.
        self._silent: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._partial: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._idle: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._busy: set[_Conn] = set()  # with a worker
        self._lock = threading.Lock()  # guards _busy (workers and the admitting thread)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._admit_loop, name="ckptd-peer-accept",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"ckptd-peer-{n}",
                                           daemon=True) for n in range(max(1, workers))]

    def start(self) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        for t in self._threads:
            t.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._silent) + len(self._partial) + len(self._idle) + len(self._busy)

    def close(self) -> None:
        """Stops accepting, closes every connection, and joins the threads."""
        self._stop.set()
        self._wake()
        with self._lock:
            busy = list(self._busy)
        for conn in busy:  # a worker blocked in a send returns at once
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for _ in self._threads[1:]:
            self._ready.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5.0)
        if not self._threads[0].is_alive():
            self._close_all()

    def _close_all(self) -> None:
        for waiting in (self._silent, self._partial, self._idle):
            for conn in list(waiting.values()):
                self._drop(conn)
        while True:
            try:
                self._drop(self._returned.get_nowait())
            except queue.Empty:
                break
        with contextlib.suppress(Exception):
            self._selector.close()
        for s in (self.socket, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the admitting thread: accepts, reads heads, times out, evicts ----------------

    def _admit_loop(self) -> None:
        try:
            while not self._stop.is_set():
                events = self._selector.select(self._next_deadline())
                for key, _ in events:
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_returned()
                    else:
                        self._read(key.data)
                self._expire(time.monotonic())
        except Exception:  # never leave the process with a dead peer server silently
            log.exception("the peer server's admitting thread failed")
        finally:
            self._close_all()

    def _next_deadline(self) -> float:
        """Seconds until the selector must look at the time again (at most 0.25)."""
        fronts = [next(iter(q.values())) for q in (self._silent, self._partial, self._idle) if q]
        if not fronts:
            return 0.25
        soonest = min(self._deadline(c) for c in fronts)
        return min(0.25, max(0.0, soonest - time.monotonic()))

    def _deadline(self, conn: _Conn) -> float:
        if conn.first_byte is not None:
            return conn.first_byte + self.head_timeout
        return conn.since + (self.idle_timeout if conn.served else self.head_timeout)

    def _accept(self) -> None:
        for _ in range(16):  # then the heads already under way get their turn
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of descriptors: make room (the oldest waiting goes) and let the
                # kernel's queue hold the rest until the next turn.
                if not self._evict():
                    time.sleep(0.01)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.open_connections >= self.max_connections and not self._evict():
                # Every open connection is being answered: this one waits for none.
                if self.on_refused is not None:
                    self.on_refused()
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            self._park(_Conn(sock, time.monotonic()))

    def _evict(self) -> bool:
        """Closes one waiting connection to make room: the one that has sent part of
        a request head for the longest (a slowloris), else the one that has sent
        nothing for the longest, else the longest idle kept-alive one. A real
        client's head arrives whole, so it is never the first kind; one whose head
        has arrived meanwhile (unread yet) is served instead, and the next is looked
        at. False when every open connection is busy."""
        while True:
            queue_ = next((q for q in (self._partial, self._silent, self._idle) if q), None)
            if queue_ is None:
                return False
            victim = next(iter(queue_.values()))
            self._read(victim)
            if victim.sock.fileno() < 0:
                return True  # closed by its peer: that made the room
            if victim.where is None:
                continue  # its head was whole: dispatched
            if victim.where is not queue_:
                continue  # it sent its first bytes: looked at again in its new place
            self._drop(victim)
            if self.on_evicted is not None:
                self.on_evicted()
            return True
        return False

    def _park(self, conn: _Conn) -> None:
        """Waits for ``conn``'s next request head in the selector."""
        try:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            self._drop(conn)
            return
        where = self._partial if conn.first_byte is not None else (
            self._idle if conn.served else self._silent)
        with self._lock:
            where[conn.sock] = conn
        conn.where = where

    def _take_returned(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            if self._stop.is_set():
                self._drop(conn)
            elif not self._dispatch(conn):
                self._park(conn)

    def _read(self, conn: _Conn) -> None:
        if conn.where is None:
            return  # (an event of this turn for one dispatched or closed meanwhile)
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        if conn.first_byte is None:
            conn.first_byte = time.monotonic()
            if conn.where is not None and conn.where is not self._partial:
                with self._lock:
                    conn.where.pop(conn.sock, None)
                    self._partial[conn.sock] = conn
                conn.where = self._partial
        conn.buf += data
        if b"\r\n\r\n" in conn.buf:
            self._unpark(conn)
            self._dispatch(conn)
        elif len(conn.buf) > MAX_HEAD:
            self._unpark(conn)
            self._drop(conn)

    def _dispatch(self, conn: _Conn) -> bool:
        """Hands ``conn``'s next request to a worker when its head is whole."""
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(conn.buf[:end])
        del conn.buf[: end + 4]
        conn.first_byte = time.monotonic() if conn.buf else None
        with self._lock:
            self._busy.add(conn)
        self._ready.put((conn, head))
        return True

    def _unpark(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        if conn.where is not None:
            with self._lock:
                conn.where.pop(conn.sock, None)
            conn.where = None

    def _drop(self, conn: _Conn) -> None:
        self._unpark(conn)
        with self._lock:
            self._busy.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _expire(self, now: float) -> None:
        for waiting in (self._silent, self._partial, self._idle):
            while waiting:
                conn = next(iter(waiting.values()))
                if now <= self._deadline(conn):
                    break  # (each queue is in its deadlines' order)
                self._drop(conn)

    # -- the workers ----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._ready.get()
            if item is None:
                return
            conn, head = item
            keep = False
            try:
                keep = self._answer(conn, head)
            except Exception:  # one broken connection must not stop a worker
                log.debug("peer connection failed", exc_info=True)
            with self._lock:
                self._busy.discard(conn)
            if not keep or self._stop.is_set():
                with contextlib.suppress(OSError):
                    conn.sock.close()
                continue
            conn.served += 1
            conn.since = time.monotonic()
            self._returned.put(conn)
            self._wake()

    def _answer(self, conn: _Conn, head: bytes) -> bool:
        """Answers one request; whether the connection stays open for the next."""
        request = self._parse(conn.sock, head)
        if request is None:
            return False
        self.handler(request)
        if not request.answered or request.headers.get("connection", "").lower() == "close":
            return False
        conn.sock.setblocking(False)
        return True

    def _parse(self, sock: socket.socket, head: bytes) -> PeerRequest | None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        request = PeerRequest(sock, "", "", {}, self.write_timeout)
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            with contextlib.suppress(OSError):
                request.json(400, {"code": "invalid_request", "message": "not HTTP/1.x"},
                             {"Connection": "close"})
            return None
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                request.headers[key.strip().lower()] = value.strip()
        request.method, request.path, request.version = parts
        if parts[2] == "HTTP/1.0":
            request.headers.setdefault("connection", "close")
        if request.method != "GET" or request.headers.get("content-length", "0") != "0" or (
            "transfer-encoding" in request.headers
        ):
            with contextlib.suppress(OSError):
                request.json(405, {"code": "method_not_allowed",
                                   "message": "a peer answers GET without a body"},
                             {"Connection": "close", "Allow": "GET"})
            return None
        return request
