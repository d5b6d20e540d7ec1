"""Connections a hostile network cannot pile up: header and idle timeouts, a cap
on open connections with a coded 503, and logs that do not flood.

uvicorn times out idle keep-alive connections but not a request whose headers
never finish (slowloris), and it accepts until the process runs out of file
descriptors, after which every accept fails and logs. This protocol closes a
connection whose request headers take longer than ``header_timeout`` and answers
a connection over ``max_connections`` with 503 at once, so the descriptors that
health checks and real uploads need stay free. Stalled bodies are timed out where
they are read (``ckptd.server.bodies``)."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import threading
import time
from typing import Any

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
    """uvicorn's httptools protocol with a header timeout and a connection cap."""

    header_timeout: float = 10.0
    max_connections: int = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("over %d open connections: refusing one with 503",
                        self.max_connections)
            transport.write(_BUSY_RESPONSE)
            transport.close()
            return
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a keep-alive connection's next request
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
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


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedProtocol]:
    """``GuardedProtocol`` with these limits (uvicorn takes a protocol class)."""
    return type("GuardedProtocol", (GuardedProtocol,), {
        "header_timeout": header_timeout, "max_connections": max_connections,
    })


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
