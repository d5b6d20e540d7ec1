"""``PeerServer``: serves, by chunk id over HTTP, the chunks of this rank's pool
that a ``PeerIndex`` names, while they stay valid (the package docstring tells
the design)."""

from __future__ import annotations

import errno
import hmac
import logging
import queue
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptd import knobs
from ckptd.errors import (
    ChunkNotFound,
    CkptdError,
    Conflict,
    Unauthorized,
    Unavailable,
)

from .address import WILDCARDS, route_address
from .http import BoundedHTTPServer, PeerRequest

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
    evicted: int = 0  # closed while sending a head, to admit a newer connection
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in
                    ("served", "bytes_served", "not_found", "stale", "busy", "unauthorized",
                     "evicted")}


class PeerServer:
    """Serves the published chunks of this process's staging pool to peers.

    ``start()`` binds ``host:port`` (``CKPTD_PEER_HOST``, default 127.0.0.1 here;
    a ``Checkpointer`` binds every interface, ``address.py``; ``CKPTD_PEER_PORT``,
    default 0: the OS picks) and returns at once; ``url`` is what peers should use
    (``advertise_host``, else the bound address, else the address on the route to
    ``route_to``, the ckptd server). ``publish(index)`` replaces what is served;
    ``close()`` stops serving and drops open connections. A request that finds all
    ``concurrency`` slots taken waits ``busy_wait`` seconds for one, then gets 503.

    Every request but ``/healthz`` must carry the job's peer token
    (``set_token``, from the server's heartbeat replies; ``token`` to start with):
    until one is set, nothing is served. Connections are admitted and their heads
    read by one thread, requests answered by a fixed pool of threads, with read
    deadlines and at most ``max_connections`` open (``peer.http.BoundedHTTPServer``).
    A chunk goes out straight from the pool to a client that reads trailers
    (``PeerClient``), with its seqlock validity after it; to others, copied out
    first."""

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
        max_connections: int | None = None,
    ) -> None:
        self.host = (knobs.peer_host() or "127.0.0.1") if host is None else host
        self.port = knobs.peer_port() if port is None else int(port)
        self._tokens: tuple[str, ...] = (token,) if token else ()
        self.route_to = route_to
        self.head_timeout = head_timeout
        self.max_connections = max_connections  # None: a share of the open-file limit
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
                    workers=self.concurrency + 4, max_connections=self.max_connections,
                    head_timeout=self.head_timeout, idle_timeout=self.head_timeout,
                    on_refused=lambda: self.stats.add("busy"),
                    on_evicted=lambda: self.stats.add("evicted"),
                )
            except OSError as exc:
                why = exc.strerror or str(exc)
                if exc.errno == errno.EADDRINUSE and self.port:
                    why += (" (another process holds it: a port per rank of the host, "
                            "CKPTD_PEER_PORT + LOCAL_RANK, free on every host, or "
                            "CKPTD_PEER_PORT unset, so that the OS chooses)")
                raise Unavailable(f"peer chunk server cannot bind {self.host}:{self.port}: "
                                  f"{why}", host=self.host, port=self.port) from None
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
            if host in WILDCARDS:
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
            # Seqlock read: valid before, bytes out, valid after. A save that started
            # overwriting the pool in between makes them worthless: never passed on.
            if not index.valid():
                self._stale(request, cid)
                return
            headers = {"Content-Type": "application/octet-stream"}
            if index.step is not None:
                headers["X-Ckptd-Step"] = str(index.step)
            if request.wants_trailers():
                # Straight from the pool (the kernel's copy is the only one); the
                # trailer says whether the pool still held them once sent, and a
                # client that asked for it drops them otherwise (PeerClient: 409).
                def counted() -> bool:  # (counted before the client can read the verdict)
                    valid = index.valid()
                    self._count(view if valid else None)
                    return valid

                request.send_checked(200, headers, view, counted)
            else:
                self._send_copied(request, cid, headers, view, index)
        finally:
            self._slots.release()

    def _count(self, sent: memoryview | None) -> None:
        """Counts a chunk served (None: refused, it was being overwritten)."""
        if sent is None:
            self.stats.add("stale")
        else:
            self.stats.add("served")
            self.stats.add("bytes_served", len(sent))

    def _send_copied(self, request: PeerRequest, cid: str, headers: dict[str, str],
                     view: memoryview, index: PeerIndex) -> None:
        """For a client that reads no trailers: the bytes copied out of the pool
        first and checked valid after the copy, then sent with their length."""
        n = len(view)
        scratch = self._take_scratch(n)
        try:
            out = memoryview(scratch)[:n]
            out[:] = view
            if not index.valid():
                self._stale(request, cid)
                return
            self._count(view)  # (before the client can have the answer)
            request.send(200, headers, out)
            out.release()
        finally:
            self._scratch.put(scratch)

    def _stale(self, request: PeerRequest, cid: str) -> None:
        self._count(None)
        request.json(409, Conflict(f"chunk {cid} is being overwritten", id=cid).to_json())

    def _take_scratch(self, n: int) -> bytearray:
        try:
            buf = self._scratch.get_nowait()
        except queue.Empty:
            buf = bytearray(n)
        if len(buf) < n:
            buf = bytearray(n)
        return buf
