"""Peer chunk serving: each training process serves, by chunk id over HTTP, the
chunks of its staging pool that belong to a committed step, so a replacement rank
on another node can restore from its data-parallel replicas instead of the store.

Server
    ``PeerServer`` is a small HTTP/1.1 server on a fixed pool of daemon threads
    with read deadlines (``peer_http``; no event loop to share with training, no
    thread per connection, and ``socket.sendall`` of a pool view is as fast as
    loopback gets). ``GET /v1/chunks/{id}`` answers the chunk's raw bytes, ``GET
    /v1/peer`` what the peer holds. It serves only what ``publish`` handed it: a
    ``PeerIndex`` of chunk id -> bytes in the pool, built from a committed
    manifest (or from chunks of a re-adopted pool that were verified against one),
    with a ``valid`` check. For the live pool that check is the staging seqlock:
    the generation must be the one the index was built at, before and after the
    bytes are copied out, so a chunk whose buffer a new ``save`` is overwriting is
    refused with 409 (the client then tries another source) and never sent torn.
    Copies go through scratch buffers reused from request to request, the
    number of requests served at once is bounded (``CKPTD_PEER_CONCURRENCY``;
    others wait a moment, then get 503), and every request must carry the job's
    peer token (``Authorization: Bearer``), which the server hands to the job's
    ranks, so a peer neither starves training nor serves another job.

Client
    ``PeerClient`` fetches a chunk straight into the caller's buffer over
    kept-alive blocking sockets (``recv_into`` with ``MSG_WAITALL``: no
    intermediate copy, one system call per chunk; httpx reached 0.4 times its
    throughput on loopback, ``http.client`` used twice its CPU), and raises typed errors:
    ``ChunkNotFound`` (404), ``Conflict`` (409: being overwritten), ``Unavailable``
    (refused, reset, 503, short body), ``ChunkSizeMismatch``. It does not hash:
    the restore engine verifies every chunk against its id on arrival.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import http.client
import json
import logging
import queue
import re
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from ckptd import knobs
from ckptd.errors import (
    ChunkNotFound,
    ChunkSizeMismatch,
    CkptdError,
    Conflict,
    InvalidRequest,
    Unauthorized,
    Unavailable,
    from_json,
)

from .peer_http import BoundedHTTPServer, PeerRequest

log = logging.getLogger(__name__)

_CHUNK_PATH = re.compile(r"^/v1/chunks/([0-9a-f]{64})$")
_BUSY_WAIT = 2.0  # seconds a request waits for a serving slot before 503


def _always() -> bool:
    return True


@dataclass(frozen=True, slots=True)
class PeerIndex:
    """What a peer serves: chunk id -> its bytes (a view of the pool), the
    committed step they belong to, and ``valid``, true while the views still hold
    those bytes (the staging seqlock for a live pool)."""

    step: int | None
    chunks: Mapping[str, memoryview]
    valid: Callable[[], bool] = _always

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.chunks.values())


EMPTY_INDEX = PeerIndex(step=None, chunks={})


@dataclass(slots=True)
class PeerStats:
    """Counts of what a peer server answered."""

    served: int = 0
    bytes_served: int = 0
    not_found: int = 0
    stale: int = 0  # refused: the buffer was being overwritten
    busy: int = 0  # refused: too many requests at once
    unauthorized: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in
                    ("served", "bytes_served", "not_found", "stale", "busy", "unauthorized")}


def route_address(toward: str | None = None) -> str:
    """This host's address on the route toward ``toward`` (a URL or host; default:
    the default route), as peers and the server see it: never ``localhost``. A UDP
    ``connect`` sends nothing; it only asks the kernel which source it would use."""
    host = urlparse(toward).hostname if toward and "//" in toward else toward
    target = host or "10.255.255.255"
    try:
        infos = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class PeerServer:
    """Serves the published chunks of this process's staging pool to peers.

    ``start()`` binds ``host:port`` (``CKPTD_PEER_HOST``, default 127.0.0.1;
    ``CKPTD_PEER_PORT``, default 0: the OS picks) and returns at once; ``url`` is
    what peers should use. ``publish(index)`` replaces what is served;
    ``close()`` stops serving and drops open connections. A request that finds all
    ``concurrency`` slots taken waits ``busy_wait`` seconds for one, then gets 503.

    Every request but ``/healthz`` must carry the job's peer token
    (``set_token``, from the server's heartbeat replies; ``token`` to start with):
    until one is set, nothing is served. Connections are served by a fixed pool of
    threads with read deadlines (``peer_http.BoundedHTTPServer``)."""

    def __init__(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        token: str | None = None,
        concurrency: int | None = None,
        advertise_host: str | None = None,
        job: str | None = None,
        rank: int | None = None,
        busy_wait: float = _BUSY_WAIT,
        route_to: str | None = None,
        head_timeout: float = 5.0,
    ) -> None:
        self.host = knobs.peer_host() if host is None else host
        self.port = knobs.peer_port() if port is None else int(port)
        self._tokens: tuple[str, ...] = (token,) if token else ()
        self.route_to = route_to
        self.head_timeout = head_timeout
        self.concurrency = max(1, knobs.peer_concurrency() if concurrency is None
                               else int(concurrency))
        self.advertise_host = advertise_host or knobs.peer_advertise_host()
        self.job = job
        self.rank = rank
        self.busy_wait = busy_wait
        self.stats = PeerStats()
        self._index = EMPTY_INDEX
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._scratch: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._httpd: BoundedHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> PeerServer:
        """Binds and starts serving on a daemon thread. Idempotent."""
        with self._lock:
            if self._httpd is not None:
                return self
            try:
                httpd = BoundedHTTPServer(
                    (self.host, self.port), self._handle,
                    workers=self.concurrency + 4, queued=64, head_timeout=self.head_timeout,
                    idle_timeout=self.head_timeout, on_refused=lambda: self.stats.add("busy"),
                )
            except OSError as exc:
                raise Unavailable(
                    f"peer chunk server cannot bind {self.host}:{self.port}: {exc}",
                    host=self.host, port=self.port,
                ) from exc
            self.port = int(httpd.server_address[1])
            self._httpd = httpd
            httpd.start()
        log.info("peer chunk server for %s/%s at %s", self.job, self.rank, self.url)
        return self

    @property
    def url(self) -> str:
        """``http://host:port`` peers reach this server at."""
        host = self.advertise_host
        if host is None:
            host = self.host
            if host in ("", "0.0.0.0", "::"):
                # The address on the route to the ckptd server: the one its
                # heartbeats come from, which the server accepts (getfqdn() gave
                # "localhost" on many hosts).
                host = route_address(self.route_to)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def close(self) -> None:
        """Stops serving, closes the listening socket and every open connection."""
        with self._lock:
            httpd, self._httpd = self._httpd, None
        self._index = EMPTY_INDEX
        if httpd is not None:
            httpd.close()

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- who may ask --------------------------------------------------------------------

    def set_token(self, token: str | None) -> None:
        """The job's peer token from now on (the one before it still counts, so
        that restores planned just before a change go on)."""
        if token and (not self._tokens or token != self._tokens[0]):
            self._tokens = (token, *self._tokens[:1])

    @property
    def token(self) -> str | None:
        return self._tokens[0] if self._tokens else None

    def _authorized(self, request: PeerRequest) -> bool:
        got = request.headers.get("authorization", "").encode()
        ok = False
        for token in self._tokens:  # every one compared: constant time in the token
            ok |= hmac.compare_digest(got, f"Bearer {token}".encode())
        if not ok:
            self.stats.add("unauthorized")
            request.json(401, Unauthorized("missing or wrong peer token").to_json(),
                         {"WWW-Authenticate": "Bearer"})
        return ok

    def _handle(self, request: PeerRequest) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            request.json(200, {"status": "ok"})
            return
        if not self._authorized(request):
            return
        if path == "/v1/peer":
            request.json(200, self.describe())
            return
        match = _CHUNK_PATH.match(path)
        if match is None:
            request.json(404, CkptdError(f"no route {path[:200]}").to_json())
            return
        self.serve_chunk(request, match.group(1))

    # -- what is served -----------------------------------------------------------------

    def publish(self, index: PeerIndex) -> None:
        """Serves ``index`` from now on (replacing what was served)."""
        self._index = index
        log.debug("peer %s/%s: serving %d chunks (%d bytes) of step %s",
                  self.job, self.rank, len(index.chunks), index.nbytes, index.step)

    def clear(self) -> None:
        """Serves nothing (a new save is about to overwrite the pool)."""
        self._index = EMPTY_INDEX

    @property
    def index(self) -> PeerIndex:
        return self._index

    @property
    def held_step(self) -> int | None:
        """The committed step whose chunks are served now, if they are still valid."""
        index = self._index
        return index.step if index.chunks and index.valid() else None

    def describe(self) -> dict[str, Any]:
        index = self._index
        valid = bool(index.chunks) and index.valid()
        return {
            "job": self.job,
            "rank": self.rank,
            "step": index.step if valid else None,
            "chunks": len(index.chunks) if valid else 0,
            "stats": self.stats.as_dict(),
        }

    # -- serving ------------------------------------------------------------------------

    def serve_chunk(self, request: PeerRequest, cid: str) -> None:
        if not self._slots.acquire(timeout=self.busy_wait):
            self.stats.add("busy")
            request.json(503, Unavailable("peer busy: too many chunk requests at once")
                         .to_json(), {"Retry-After": "1"})
            return
        try:
            index = self._index
            view = index.chunks.get(cid)
            if view is None:
                self.stats.add("not_found")
                request.json(404, ChunkNotFound(f"this peer does not hold chunk {cid}", id=cid)
                             .to_json())
                return
            # Seqlock read: valid before, copy out, valid after. A save that started
            # overwriting the pool in between makes the copy worthless: refuse it.
            if not index.valid():
                self.stats.add("stale")
                request.json(409, Conflict(f"chunk {cid} is being overwritten", id=cid).to_json())
                return
            n = len(view)
            scratch = self._take_scratch(n)
            try:
                out = memoryview(scratch)[:n]
                out[:] = view
                if not index.valid():
                    self.stats.add("stale")
                    request.json(409, Conflict(f"chunk {cid} is being overwritten", id=cid)
                                 .to_json())
                    return
                headers = {"Content-Type": "application/octet-stream"}
                if index.step is not None:
                    headers["X-Ckptd-Step"] = str(index.step)
                request.send(200, headers, out)
                out.release()
            finally:
                self._scratch.put(scratch)
            self.stats.add("served")
            self.stats.add("bytes_served", n)
        finally:
            self._slots.release()

    def _take_scratch(self, n: int) -> bytearray:
        try:
            buf = self._scratch.get_nowait()
        except queue.Empty:
            buf = bytearray(n)
        if len(buf) < n:
            buf = bytearray(n)
        return buf


# -- the client -------------------------------------------------------------------------


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
        self, token: str | None = None, *, timeout: float | None = None, idle_per_peer: int = 8
    ) -> None:
        self.timeout = knobs.peer_timeout() if timeout is None else timeout
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
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




# -- one rank's presence: serving its pool and heartbeating ---------------------------


class PeerService:
    """What a ``Checkpointer`` runs for failover: the peer chunk server (when
    ``serve``) and the heartbeat thread (``heartbeat``, for an HTTP server), kept in
    agreement: what the server serves is what heartbeats call ``held_step``.

    A live pool's chunks are published once their step committed (``committed``,
    or ``pending`` to publish when a heartbeat sees the commit); ``staging`` is
    called before a save overwrites the pool (the live index stops being valid
    then anyway, through the seqlock; this also stops advertising it). Chunks of a
    re-adopted pool (``adopted``, verified against a committed manifest) are served
    until this process first stages: its index's ``valid`` is that pool's
    generation, which the first stage bumps."""

    def __init__(self, server: PeerServer | None, heartbeat: Any | None) -> None:
        self.server = server
        self.heartbeat = heartbeat
        self._adopted: Any | None = None  # keeps the adopted pool's views mapped
        self._live = False
        self._lock = threading.Lock()
        if heartbeat is not None and server is not None:
            heartbeat.set_peer_url(server.url)
            # The job's peer token comes with heartbeat replies: never the client's
            # server token (a peer would hold the key to the whole server).
            heartbeat.on_peer_token = server.set_token

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def start(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start()
            # A process that ends without close() still leaves cleanly (a killed one
            # cannot, and shows dead): the hook holds no reference to this service.
            atexit.register(_goodbye_at_exit, weakref.ref(self))

    def note_step(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.note_step(step)

    def staging(self) -> None:
        """A save is about to stage into the pool: what is served now stops being
        valid (the seqlock would refuse it anyway); stop advertising it."""
        with self._lock:
            self._live = False
            old, self._adopted = self._adopted, None
            if self.server is not None:
                self.server.clear()
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        if self.heartbeat is not None:
            self.heartbeat.set_held_step(None, wake=False)

    def committed(self, index: PeerIndex) -> None:
        """The live pool holds committed step ``index.step``: serve it (unless a
        newer save already began overwriting it)."""
        if not index.valid():
            return
        with self._lock:
            if self.server is not None:
                self.server.publish(index)
            self._live = True
            old, self._adopted = self._adopted, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        if self.heartbeat is not None and index.step is not None:
            self.heartbeat.set_held_step(index.step)

    def pending(self, index: PeerIndex) -> None:
        """The live pool holds step ``index.step``, not committed yet: publish it
        once a heartbeat sees it committed (still valid then)."""
        step = index.step
        if self.heartbeat is None or step is None:
            return

        def publish(_: int) -> None:
            if index.valid():
                self.committed(index)

        self.heartbeat.hold_when_committed(step, publish)

    def adopted(self, index: PeerIndex, keep: Any, *, beat: bool = True) -> None:
        """Verified chunks of a re-adopted pool (``keep`` holds their mapping):
        served unless the live pool already serves a committed step."""
        with self._lock:
            if self._live:
                with contextlib.suppress(Exception):
                    keep.close()
                return
            old, self._adopted = self._adopted, keep
            if self.server is not None:
                self.server.publish(index)
        if old is not None and old is not keep:
            with contextlib.suppress(Exception):
                old.close()
        if self.heartbeat is not None and index.step is not None:
            self.heartbeat.set_held_step(index.step, wake=not beat)
            if beat:
                self.heartbeat.beat_now()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(goodbye=True)
        if self.server is not None:
            self.server.close()
        with self._lock:
            old, self._adopted = self._adopted, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()


def _goodbye_at_exit(ref: weakref.ref[PeerService]) -> None:
    service = ref()
    if service is not None and service.heartbeat is not None:
        service.heartbeat.stop(timeout=1.0, goodbye=True)


__all__ = [
    "EMPTY_INDEX",
    "PeerClient",
    "PeerIndex",
    "PeerServer",
    "PeerService",
    "PeerStats",
    "wait_listening",
]
