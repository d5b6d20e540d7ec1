"""``PeerClient``: fetches a chunk from a peer straight into the caller's buffer
over kept-alive blocking sockets, with typed errors (it does not hash: the
restore engine verifies every chunk)."""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse, urlsplit

from ckptd import knobs
from ckptd.chunk_reads import CHUNK_SIZES_HEADER, parse_chunk_sizes
from ckptd.errors import (
    ChunkNotFound,
    ChunkSizeMismatch,
    CkptdError,
    Conflict,
    InvalidRequest,
    Unavailable,
)

from .answers import (
    BodyStream,
    Disconnected,
    answer_error,
    check_deadline,
    chunk_size,
    content_length,
    keep_alive,
    read_head,
)
from .http import VALID_TRAILER

log = logging.getLogger(__name__)

# The slowest a peer may send and still be waited for: a request's deadline is the
# timeout plus its body at this rate (each read has the timeout on its own too).
MIN_RATE = float(knobs.MiB)

T = TypeVar("T")


def _peer_address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
        raise InvalidRequest(f"peer URL {url!r} is not http://host:port")
    return parsed.hostname, parsed.port


def _endpoint(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http:// or https:// URL (default ports filled in)."""
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InvalidRequest(f"URL {url[:200]!r} is not http(s)://host[:port]/...")
    return parsed.scheme, parsed.hostname, parsed.port or (443 if parsed.scheme == "https"
                                                            else 80)



# A connection that could not be made because the host is not there for this one:
# refused, a name that does not resolve here, no route (the host or the network).
_NO_WAY = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def _connect_failure(exc: OSError) -> str:
    """The ``reason`` of a connection ``exc`` kept from being made: ``unreachable``
    (asking the host again will not help: its sources stop asking it), ``timeout``,
    or ``failed`` (a TLS handshake, ...)."""
    if isinstance(exc, socket.gaierror):  # (EAI_AGAIN: a resolver that failed for now)
        return "failed" if exc.errno == socket.EAI_AGAIN else "unreachable"
    if isinstance(exc, ConnectionRefusedError) or exc.errno in _NO_WAY:
        return "unreachable"
    return "timeout" if isinstance(exc, TimeoutError) else "failed"


class _Conn:
    """One kept-alive connection to a peer (or an object store): a blocking socket
    (so that a body can be read with ``MSG_WAITALL``, one system call per chunk)
    whose send and receive timeouts are set in the kernel; over TLS, reads with
    Python's own timeout (a TLS socket takes no ``MSG_WAITALL``)."""

    __slots__ = ("cut", "deadline", "flags", "sock", "url")

    def __init__(self, url: str, timeout: float, tls: ssl.SSLContext | None = None,
                 connect_timeout: float | None = None) -> None:
        scheme, host, port = _endpoint(url)
        self.url = url
        self.cut = False  # ended by ``PeerClient.cut``: its peer was marked down
        self.deadline = float("inf")  # of the request under way (``PeerClient._exchange``)
        # A host that vanished answers no SYN: connecting is bounded on its own, so a
        # lost peer or replica costs seconds, not the whole read timeout.
        sock = socket.create_connection(
            (host, port), timeout=timeout if connect_timeout is None else connect_timeout)
        sock.settimeout(timeout)  # TLS reads: the request's timeout, not the connect's
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            try:
                self.sock: socket.socket = (tls or ssl.create_default_context()).wrap_socket(
                    sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
            self.flags = 0
            return
        self.sock = sock
        self.flags = socket.MSG_WAITALL
        sock.settimeout(None)  # blocking: MSG_WAITALL then waits for the whole body
        sec = int(timeout)
        tv = struct.pack("ll", sec, int((timeout - sec) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

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
        headers: Mapping[str, str] | None = None, tls: ssl.SSLContext | None = None,
        label: str = "peer",
    ) -> None:
        self.timeout = knobs.peer_timeout() if timeout is None else timeout
        #: what the errors call the far end: a ``peer``, the ``ckptd server`` (the
        #: store tier's reads), the ``object store`` (presigned reads)
        self.label = label
        self._tls = tls  # for https:// (object stores; peers speak plain HTTP)
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
        self._busy: set[_Conn] = set()

    def _take(self, url: str) -> tuple[_Conn, bool]:
        with self._lock:
            idle = self._idle.get(url)
            if idle:
                conn = idle.pop()
                self._busy.add(conn)
                return conn, True
        return self._open(url), False

    def _open(self, url: str) -> _Conn:
        conn = _Conn(url, self.timeout, self._tls,
                     connect_timeout=min(self.timeout, knobs.connect_timeout()))
        with self._lock:
            if self._closed:
                conn.close()
                raise Disconnected("the peer client was aborted")
            self._busy.add(conn)
        return conn

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            self._busy.discard(conn)
            idle = self._idle.setdefault(conn.url, [])
            if not self._closed and len(idle) < self._idle_per_peer:
                idle.append(conn)
                return
        conn.close()

    def fetch_into(self, url: str, cid: str, dest: memoryview) -> int:
        """Reads chunk ``cid`` from the peer at ``url`` into ``dest`` (which must be
        exactly the chunk's length); returns the bytes read. Unverified."""
        _peer_address(url)
        # TE: trailers lets a peer send from its pool without copying the chunk out
        # first: its validity then follows the body (``PeerRequest.send_checked``).
        request = (f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: peer\r\nTE: trailers\r\n"
                   f"{self._auth}\r\n").encode("ascii")
        return self._exchange(url, lambda conn: self._get(conn, url, cid, request, dest))

    def get_into(self, url: str, dest: memoryview, cid: str | None = None) -> int:
        """The body of ``GET url`` (http:// or https://, any path and query: a
        presigned object-store URL) into ``dest``, which must be exactly its length;
        returns the bytes read. None of this client's headers go with it: its token
        is for peers, never for another host. ``cid``: the chunk it is, for errors.
        Unverified."""
        parts = urlsplit(url)
        _endpoint(url)
        origin = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if any(c in target for c in "\r\n "):
            raise InvalidRequest(f"URL {url[:200]!r} holds a space or a line break")
        request = (f"GET {target} HTTP/1.1\r\nHost: {origin.split('//', 1)[1]}\r\n\r\n"
                   .encode("ascii"))
        return self._exchange(origin, lambda conn: self._get(conn, origin, cid, request, dest))

    def fetch_many_into(
        self, url: str, chunks: Sequence[tuple[str, memoryview]],
        each: Callable[[int, CkptdError | None], None],
    ) -> None:
        """Reads several chunks of a ckptd server in one request (``POST
        /v1/chunks/read``), each into its buffer (exactly the chunk's length).
        ``each(i, None)`` runs, in this thread, as soon as chunk ``i`` is in its
        buffer (unverified), ``each(i, error)`` for one the answer does not hold right
        (``ChunkNotFound``, ``ChunkSizeMismatch``); a request that fails as a whole
        raises its typed error, and the chunks not given to ``each`` by then were not
        read."""
        body = json.dumps({"ids": [cid for cid, _ in chunks]}).encode("ascii")
        given: list[int] = []

        def counted(i: int, error: CkptdError | None) -> None:
            given.append(i)
            each(i, error)

        self._exchange(url, lambda conn: self._fetch_many(conn, url, chunks, body, counted),
                       again=lambda: not given)

    def _exchange(self, url: str, talk: Callable[[_Conn], T],
                  again: Callable[[], bool] = lambda: True) -> T:
        """``talk`` over a kept-alive connection to ``url``, once more over a fresh one
        when the peer had closed the idle one (and ``again()``: nothing of the answer
        was handed on yet); typed errors."""
        for attempt in range(2):
            try:
                # The retry takes a fresh connection: another idle one may be closed too.
                conn, reused = self._take(url) if attempt == 0 else (
                    self._open(url), False)
            except OSError as exc:
                reason = _connect_failure(exc)
                raise Unavailable(f"{self.label} {url}: {type(exc).__name__}: {exc}",
                                  peer=url, reason=reason) from exc
            # The whole request has a deadline, not only each read: a peer that
            # trickles a byte at a time would keep every read alive forever.
            conn.deadline = time.monotonic() + self.timeout
            try:
                return _talked(conn, talk)
            except CkptdError:
                raise  # an answer (the connection was returned or closed already)
            except (Disconnected, BrokenPipeError, ConnectionResetError) as exc:
                conn.close()
                if reused and attempt == 0 and again():
                    continue  # the peer closed an idle connection: once more, fresh
                raise Unavailable(f"{self.label} {url} dropped the connection: {exc}", peer=url,
                                  reason="disconnected") from exc
            except (BlockingIOError, TimeoutError) as exc:
                conn.close()
                raise Unavailable(f"{self.label} {url} timed out after {self.timeout} s", peer=url,
                                  reason="timeout") from exc
            except (OSError, ValueError) as exc:
                conn.close()
                raise Unavailable(f"{self.label} {url}: {type(exc).__name__}: {exc}", peer=url,
                                  reason="failed") from exc
            except BaseException:
                conn.close()
                raise
            finally:
                with self._lock:
                    self._busy.discard(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def _get(self, conn: _Conn, url: str, cid: str | None, request: bytes,
             dest: memoryview) -> int:
        sock = conn.sock
        sock.sendall(request)
        headers, extra, n, keep = self._answer(conn, url, cid, len(dest))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return self._fetch_chunked(conn, url, cid, dest, extra, keep)
        if n != len(dest) or len(extra) > n:
            conn.close()
            raise ChunkSizeMismatch(
                f"{url} sent {n} bytes for chunk {cid}, expected {len(dest)}",
                id=cid, peer=url,
            )
        got = len(extra)
        dest[:got] = extra
        while got < n:
            k = sock.recv_into(dest[got:], n - got, conn.flags)
            if not k:
                conn.close()
                raise Unavailable(f"{url} sent {got} of {n} bytes of chunk {cid}",
                                  peer=url, reason="short")
            got += k
            check_deadline(conn.deadline, got < n)
        if keep:
            self._give(conn)
        else:
            conn.close()
        return got

    def _fetch_chunked(self, conn: _Conn, url: str, cid: str | None, dest: memoryview,
                       extra: memoryview, keep: bool) -> int:
        """A chunked answer's body into ``dest``, then its trailer: a peer that sent
        from memory that changed under the send says so there (``X-Ckptd-Valid:
        0``), and the bytes are refused as a 409 would have refused them."""
        stream = BodyStream(conn.sock, extra, conn.deadline, conn.flags)
        got = 0
        while True:
            size = chunk_size(stream.line())
            if size == 0:
                break
            if got + size > len(dest):
                conn.close()
                raise ChunkSizeMismatch(f"{self.label} {url} sent more than the {len(dest)} "
                                        f"bytes of chunk {cid}", id=cid, peer=url)
            stream.read_into(dest[got : got + size])
            got += size
            if stream.line():
                raise ValueError("a chunk of a chunked answer ends without its CRLF")
        trailers = {}
        while line := stream.line():
            key, sep, value = line.partition(b":")
            if sep:
                trailers[key.strip().lower().decode("latin-1")] = value.strip()
        if keep and not stream.extra:
            self._give(conn)
        else:
            conn.close()
        if got != len(dest):
            raise ChunkSizeMismatch(f"{self.label} {url} sent {got} bytes for chunk {cid}, "
                                    f"expected {len(dest)}", id=cid, peer=url)
        if trailers.get(VALID_TRAILER.lower()) == b"0":
            raise Conflict(f"{self.label} {url}: chunk {cid} was overwritten while it was sent",
                           id=cid, peer=url)
        return got

    def _fetch_many(
        self, conn: _Conn, url: str, chunks: Sequence[tuple[str, memoryview]], body: bytes,
        each: Callable[[int, CkptdError | None], None],
    ) -> None:
        sock = conn.sock
        sock.sendall(f"POST /v1/chunks/read HTTP/1.1\r\nHost: peer\r\n{self._auth}"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode("ascii") + body)
        headers, extra, n, keep = self._answer(conn, url, None, 0)
        sizes = parse_chunk_sizes(headers.get(CHUNK_SIZES_HEADER.lower(), ""), len(chunks))
        if n != sum(k or 0 for k in sizes):
            raise ValueError(f"a body of {n} bytes for chunks of {sum(k or 0 for k in sizes)}")
        stream = BodyStream(sock, extra, conn.deadline, conn.flags)
        for i, ((cid, dest), size) in enumerate(zip(chunks, sizes, strict=True)):
            if size is None:
                each(i, ChunkNotFound(f"{url} does not hold chunk {cid}", id=cid, peer=url))
            elif size != len(dest):
                stream.skip(size)
                each(i, ChunkSizeMismatch(f"{url} sent {size} bytes for chunk {cid}, "
                                          f"expected {len(dest)}", id=cid, peer=url))
            else:
                stream.read_into(dest)
                each(i, None)
        if keep and not stream.extra:
            self._give(conn)
        else:
            conn.close()

    def _answer(self, conn: _Conn, url: str, cid: str | None, expect: int
                ) -> tuple[dict[str, str], memoryview, int, bool]:
        """A 200 answer's headers, what came past them, its body length (-1: not
        given) and whether the connection is kept; another status raises its typed
        error. The request's deadline grows by the body (``expect`` bytes when the
        answer gives no length) at the slowest rate waited for."""
        status, headers, extra = read_head(conn.sock, conn.deadline)
        n, keep = content_length(headers), keep_alive(headers)
        if status != 200:
            raise answer_error(status, self._error_body(conn, extra, n, keep), url, cid)
        conn.deadline += (n if n >= 0 else expect) / MIN_RATE
        return headers, extra, n, keep

    def _error_body(self, conn: _Conn, extra: memoryview, n: int, keep: bool) -> bytes:
        """An error answer's body (its first MiB); the connection goes back when the
        body was read whole."""
        body = bytearray(extra)
        if n > len(body):
            more = bytearray(min(n, 1 << 20) - len(body))
            got = conn.sock.recv_into(more, len(more), conn.flags) if more else 0
            body += more[:got]
        if keep and n >= 0 and len(body) == n:
            self._give(conn)
        else:
            conn.close()
        return bytes(body)

    def describe(self, url: str) -> dict[str, Any]:
        """What the peer at ``url`` says it holds (``GET /v1/peer``: its job, rank, the
        step it serves, how many chunks), with typed errors (``Unauthorized`` for a
        wrong token)."""
        return self._exchange(url, lambda conn: self._describe(conn, url))

    def _describe(self, conn: _Conn, url: str) -> dict[str, Any]:
        conn.sock.sendall(f"GET /v1/peer HTTP/1.1\r\nHost: peer\r\n{self._auth}\r\n"
                          .encode("ascii"))
        _, extra, n, keep = self._answer(conn, url, None, 1 << 20)
        if not 0 <= n <= 1 << 20:
            conn.close()
            raise Unavailable(f"peer {url} described itself in {n} bytes", peer=url,
                              reason="status")
        body = bytearray(n)
        stream = BodyStream(conn.sock, extra, conn.deadline)
        stream.read_into(memoryview(body))
        if keep and not stream.extra:
            self._give(conn)
        else:
            conn.close()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise Unavailable(f"peer {url} did not describe itself", peer=url, reason="status")
        return doc

    def cut(self, url: str) -> None:
        """Ends the requests under way to ``url`` at once (``Unavailable``, reason
        ``down``: not tried again on a fresh connection) and drops its idle
        connections: for a caller that learned ``url`` hangs (routing marked it
        down). Later requests to it open fresh connections. Thread-safe."""
        with self._lock:
            busy = [c for c in self._busy if c.url == url]
            idle = self._idle.pop(url, [])
            for conn in busy:
                conn.cut = True
        for conn in busy:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for conn in idle:
            conn.close()

    def abort(self) -> None:
        """Ends every request under way at once (their reads fail, ``disconnected``)
        and refuses new ones: for a caller whose deadline passed, so that no thread
        goes on receiving into its buffers after it returned."""
        with self._lock:
            self._closed = True
            conns = [*self._busy, *(c for idle in self._idle.values() for c in idle)]
            self._idle = {}
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

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


def _talked(conn: _Conn, talk: Callable[[_Conn], T]) -> T:
    """``talk(conn)``; any failure of a connection ``PeerClient.cut`` ended is
    ``Unavailable`` (reason ``down``)."""
    try:
        return talk(conn)
    except CkptdError:
        raise
    except Exception as exc:
        if not conn.cut:
            raise
        conn.close()
        raise Unavailable(f"peer {conn.url} was marked down while it answered",
                          peer=conn.url, reason="down") from exc


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
