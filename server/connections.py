"""Connections a hostile network cannot pile up: header and idle timeouts, a cap
on open connections that admits a new connection by closing the one that has
waited longest for its request's headers, and logs that do not flood.

uvicorn times out idle keep-alive connections but not a request whose headers
never finish (slowloris), and it accepts until the process runs out of file
descriptors, after which every accept fails and logs. This protocol closes a
connection whose request headers take longer than ``header_timeout``, and holds
at most ``max_connections``: one more is admitted by closing the oldest
connection still waiting for (or still sending) a request's headers, a stalled
attacker's before anyone's request that is under way; only when every connection
is busy with a request is the new one answered 503 at once. So neither half-open
connections nor an attacker that reconnects as soon as it is closed keep health
checks and real uploads out: each newcomer is the youngest, closed last. Stalled
bodies are timed out where they are read (``ckptd.server.bodies``)."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import threading
import time
from collections import OrderedDict
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# Descriptors kept free for the store, logs and the listening socket.
SPARE_FDS = 64


def raise_fd_limit() -> int:
    """Raises this process's open-file limit to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container that forbids it: keep soft
            log.warning("cannot raise the open-file limit from %d: %s", soft, exc)
    return int(soft)


def connection_cap(wanted: int, fd_limit: int) -> int:
    """The most connections to hold open: ``wanted``, and never past the fd limit."""
    return max(1, min(wanted, fd_limit - SPARE_FDS))


_BUSY = json.dumps({
    "code": "unavailable",
    "message": "too many open connections; try again shortly",
    "detail": {},
}).encode()
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
    + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY
)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a connection cap that
    admits by closing the connection that has waited longest for a request."""

    header_timeout: float = 10.0
    max_connections: int = 1000
    # The connections waiting for a request's headers (new, idle between requests,
    # or sending a head), the longest waiting first: one per protocol class, which
    # ``ckptd.server.ingest.connection_protocol`` makes per server.
    waiting: ClassVar[OrderedDict[GuardedProtocol, None]] = OrderedDict()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._admit():
            log.warning("over %d open connections, all busy with requests: refusing one "
                        "with 503", self.max_connections)
            transport.write(_BUSY_RESPONSE)
            transport.close()
            return
        self._arm_header_timer()
        self._wait()

    def _admit(self) -> bool:
        """Makes room for this connection by closing the one that has waited longest
        for a request's headers; False when none waits."""
        while self.waiting:
            victim, _ = self.waiting.popitem(last=False)
            if victim.transport.is_closing():
                continue
            log.warning("at the cap of %d open connections: closing the one that waited "
                        "longest for a request's headers to admit a new one",
                        self.max_connections)
            victim.transport.close()
            return True
        return False

    def _wait(self) -> None:
        """Marks this connection as waiting for a request's headers (it keeps its
        place when it already waits)."""
        self.waiting.setdefault(self, None)

    def _unwait(self) -> None:
        self.waiting.pop(self, None)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a keep-alive connection's next request
            self._arm_header_timer()
        self._wait()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._unwait()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # (else the next pipelined request starts now)
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._wait()  # until the next request (or uvicorn's keep-alive timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._unwait()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %.0f s",
                     self.header_timeout)
            self.transport.close()


class RepeatFilter(logging.Filter):
    """Lets the same message through at most once per ``every`` seconds, then says
    how many were dropped: an accept() that fails in a loop must not fill the disk."""

    def __init__(self, every: float = 10.0) -> None:
        super().__init__()
        self.every = every
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last, dropped = self._seen.get(key, (-self.every, 0))
            if now - last < self.every:
                self._seen[key] = (last, dropped + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 10_000:  # many distinct messages: forget the old ones
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.every}
        if dropped:
            record.msg = f"{record.msg} (and {dropped} more like it in {self.every:.0f} s)"
        return True


REPEATS = RepeatFilter()

# Loggers whose repeated errors a hostile network can cause.
NOISY_LOGGERS = ("asyncio", "uvicorn.error", "ckptd.server.connections", "ckptd.server.errors")


def quiet_repeats() -> None:
    """Rate-limits repeated messages of the loggers a flood of connections reaches."""
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if REPEATS not in logger.filters:
            logger.addFilter(REPEATS)
