"""Telling a server whose host vanished from a busy one, on every connection the
client opens to a ckptd server.

TCP_USER_TIMEOUT alone cannot: Linux ends a connection when sent data stays
unacknowledged that long (a host that vanished: its cable pulled, nothing resets),
and also when the peer keeps its receive window shut that long, which a busy live
server does for up to its ``CKPTD_INGEST_WAIT`` (10 s) while it holds an upload back.
So connections keep the long timeout (``CKPTD_STALL_TIMEOUT``, 20 s), and a
watcher thread reads each open connection's ``TCP_INFO`` twice a second: nothing
acknowledged for ``GONE_AFTER`` seconds while data timed out again and again, or
while window probes go unanswered (the window was shut, then the host went),
means the host is gone: the replica is marked down at once (routing
sends its calls to the next one) and the connection is cut, so the request under
way fails now and its retry goes elsewhere. A busy server answers every window
probe, so its connections are left alone. Linux only; elsewhere nothing is
watched and TCP_USER_TIMEOUT alone applies.

The watcher sees connections through the httpcore network backend of the client's
transports (``guard``), which hands it each new socket."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpcore

log = logging.getLogger(__name__)

GONE_AFTER = 1.5  # seconds without an acknowledgement of data in flight
PERIOD = 0.5  # seconds between two looks at every connection
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_ESTABLISHED = 1
# struct tcp_info (linux/tcp.h): 8 one-byte fields, then 32-bit ones; tcpi_unacked is
# the 5th of those and tcpi_last_ack_recv the 13th.
_INFO = struct.Struct("=8B13I")
OnGone = Callable[[str, int], None]  # (host, port) of a connection whose host is gone


class TcpState(NamedTuple):
    state: int  # 1: established
    retransmits: int  # retransmission timeouts in a row (data unanswered)
    probes: int  # window probes (or keepalives) unanswered
    since_ack_ms: int  # since the last acknowledgement came


def tcp_state(sock: socket.socket) -> TcpState | None:
    """What TCP_INFO says of ``sock``, or None where it cannot be read."""
    if _TCP_INFO is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO.size)
    except OSError:
        return None
    if len(raw) < _INFO.size:
        return None
    fields = _INFO.unpack(raw)
    return TcpState(fields[0], fields[2], fields[3], fields[8 + 12])


def host_gone(s: TcpState) -> bool:
    """Whether a connection's ``tcp_state`` says its peer stopped answering: nothing
    acknowledged for ``GONE_AFTER`` s while data timed out twice or more, or while two
    window probes or more went unanswered. (A live peer with its window shut answers
    each probe, at longer and longer intervals: no retransmission, no probe left.)"""
    return (s.state == _ESTABLISHED and s.since_ack_ms >= GONE_AFTER * 1000
            and (s.retransmits >= 2 or s.probes >= 2))


class _Watched:
    """One connection: its httpcore stream (read again at each look: TLS replaces it)
    and what to call when its host is gone."""

    __slots__ = ("closed", "gone", "stream")

    def __init__(self, stream: Any, gone: Callable[[], None]) -> None:
        self.stream = stream
        self.gone = gone
        self.closed = False

    def socket(self) -> Any | None:
        """The connection's socket (uvloop's stand-in too), or None once closed."""
        if self.closed:
            return None
        sock = self.stream.get_extra_info("socket")
        if sock is None or not hasattr(sock, "getsockopt") or sock.fileno() < 0:
            return None
        return sock


class _Watcher:
    """The one thread that looks at every watched connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[_Watched] = []
        self._thread: threading.Thread | None = None

    def add(self, watched: _Watched) -> None:
        if _TCP_INFO is None:
            return
        with self._lock:
            self._watched.append(watched)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckptd-stall",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(PERIOD)
            with self._lock:
                self._watched = [w for w in self._watched if not w.closed]
                watched = list(self._watched)
            for w in watched:
                try:
                    self._look(w)
                except Exception as exc:  # never the watcher's end
                    log.debug("stall watcher: %s", exc)

    def _look(self, w: _Watched) -> None:
        sock = w.socket()
        if sock is None:
            w.closed = w.closed or self._gone_socket(w)
            return
        state = tcp_state(sock)
        if state is None or not host_gone(state):
            return
        w.closed = True
        log.info("a server connection has had nothing acknowledged for %.1f s: its "
                    "host is gone; cutting it", state.since_ack_ms / 1000)
        w.gone()
        _cut(sock)

    @staticmethod
    def _gone_socket(w: _Watched) -> bool:
        sock = w.stream.get_extra_info("socket")
        return sock is None or sock.fileno() < 0


def _cut(sock: Any) -> None:
    """Ends the connection now: the request on it fails at once (EOF), where its
    kernel would wait out TCP_USER_TIMEOUT. uvloop's socket stand-in has no
    shutdown(): a duplicate of its descriptor does it."""
    with contextlib.suppress(OSError):
        if isinstance(sock, socket.socket):
            sock.shutdown(socket.SHUT_RDWR)
            return
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()


_WATCHER = _Watcher()


class _AsyncStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, watched: _Watched) -> None:
        self.inner = inner
        self.watched = watched

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self.inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self.inner.write(buffer, timeout)

    async def aclose(self) -> None:
        self.watched.closed = True
        await self.inner.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        tls = await self.inner.start_tls(ssl_context, server_hostname, timeout)
        self.watched.stream = tls
        return _AsyncStream(tls, self.watched)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _SyncStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, watched: _Watched) -> None:
        self.inner = inner
        self.watched = watched

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, timeout)

    def close(self) -> None:
        self.watched.closed = True
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        tls = self.inner.start_tls(ssl_context, server_hostname, timeout)
        self.watched.stream = tls
        return _SyncStream(tls, self.watched)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


def _watched(stream: Any, host: str, port: int, on_gone: OnGone | None) -> _Watched:
    w = _Watched(stream, (lambda: on_gone(host, port)) if on_gone is not None
                 else (lambda: None))
    _WATCHER.add(w)
    return w


class _AsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend, on_gone: OnGone | None) -> None:
        self.inner = inner
        self.on_gone = on_gone

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        stream = await self.inner.connect_tcp(host, port, timeout=timeout,
                                              local_address=local_address,
                                              socket_options=socket_options)
        return _AsyncStream(stream, _watched(stream, host, port, self.on_gone))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return await self.inner.connect_unix_socket(path, timeout=timeout,
                                                    socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _SyncBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend, on_gone: OnGone | None) -> None:
        self.inner = inner
        self.on_gone = on_gone

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        stream = self.inner.connect_tcp(host, port, timeout=timeout,
                                        local_address=local_address,
                                        socket_options=socket_options)
        return _SyncStream(stream, _watched(stream, host, port, self.on_gone))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return self.inner.connect_unix_socket(path, timeout=timeout,
                                              socket_options=socket_options)

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def guard(transport: Any, on_gone: OnGone | None = None) -> Any:
    """``transport`` (an ``httpx.HTTPTransport`` or ``AsyncHTTPTransport``) with its
    new connections watched; ``on_gone(host, port)`` when one's host is gone. As it
    was where httpx's internals differ."""
    pool = getattr(transport, "_pool", None)
    inner = getattr(pool, "_network_backend", None)
    if isinstance(inner, httpcore.AsyncNetworkBackend):
        pool._network_backend = _AsyncBackend(inner, on_gone)  # type: ignore[union-attr]
    elif isinstance(inner, httpcore.NetworkBackend):
        pool._network_backend = _SyncBackend(inner, on_gone)  # type: ignore[union-attr]
    return transport
