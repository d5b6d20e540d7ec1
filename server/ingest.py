"""Chunk uploads received straight from the socket into their buffer, and chunk
requests answered without the FastAPI stack.

Through uvicorn's httptools protocol and Starlette a chunk's bytes were copied
four times in Python (uvloop's read into a ``bytes``, httptools' slice per body
piece, the request queue, our buffer) in ~64-256 KiB pieces, each with its event
loop turn and ASGI message: that was most of the server's CPU per GiB ingested
(bench/dataplane.py). Here the transport's protocol is a ``BufferedProtocol``: for
``PUT /v1/chunks/{id}`` with a ``Content-Length``, once the route has checked the
caller and holds the upload's budget, every read after the request head lands in
the chunk's own buffer (``recv_into``, as large as the socket has), and nothing
runs per piece but counting. Every other request, and the head of this one, go
to the httptools protocol as before, through one reused read buffer.

The request is still uvicorn's: the same parser reads its head, the same cycle
writes its answer (keep-alive, pipelining, the access log), only the ASGI app it
runs is the lean chunk route (``ckptd.server.routes.chunks.direct_chunk_app``)
rather than the whole FastAPI stack, which cost about a millisecond of CPU per
request: a quarter of the CPU a GiB of 4 MiB chunks takes to read back. So it is
for ``GET /v1/chunks/{id}`` too. The API, its checks and its errors are the same
(tests/integration/test_server_bodies.py runs both ways)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from ckptd.errors import BodyTimeout
from ckptd.server.bodies import PREALLOCATE, Buffer
from ckptd.server.connections import GuardedProtocol

# The scope extension that marks a request for the lean chunk route: its value is
# the upload's ``ChunkSink`` for a PUT, None for a GET.
DIRECT = "ckptd.direct"
# The request targets taken this way: nothing else (a query, an id in capitals)
# goes the ordinary way, and gets the ordinary answer.
CHUNK_PATH = re.compile(rb"/v1/chunks/[0-9a-f]{64}")
# What other requests' bytes are read into, one per thread (each read's bytes are
# copied out before the next read). The read that brings a chunk upload's head
# brings up to this much of its body, which goes the slow way (copied three times).
READ_BUFFER = 64 * 1024
# Body bytes kept before the route has given the upload a buffer (the rest of the
# read that held the head, or of a read that another request's body resumed); past
# this, reading pauses: they are outside the ingest budget.
EARLY_LIMIT = READ_BUFFER
_READ = threading.local()


def _read_buffer() -> memoryview:
    view: memoryview | None = getattr(_READ, "view", None)
    if view is None:
        view = _READ.view = memoryview(bytearray(READ_BUFFER))
    return view


class ChunkSink:
    """The body of one chunk upload as its connection receives it: kept aside until
    the route gives it a buffer (``attach``), then read into that buffer in place."""

    def __init__(self, size: int, protocol: DirectBodyProtocol) -> None:
        self.size = size
        self.filled = 0
        self.buffer: Buffer | None = None
        self.error: BaseException | None = None
        self._protocol = protocol
        self._loop = protocol.loop
        self._early: list[bytes] = []
        self._early_bytes = 0
        self._done: asyncio.Future[None] = self._loop.create_future()
        self.last_bytes = self._loop.time()
        # The client waits for "100 Continue" before it sends the body.
        self._expect_continue = protocol.expect_100_continue

    @property
    def complete(self) -> bool:
        return self._done.done()

    @property
    def receiving(self) -> bool:
        """Whether the next read goes into the buffer."""
        return self.buffer is not None and not self._done.done()

    def window(self) -> memoryview:
        """Where the next read goes: the rest of the body, no further."""
        assert self.buffer is not None
        return memoryview(self.buffer)[self.filled:self.size]

    def received(self, nbytes: int) -> None:
        """``nbytes`` more were read into ``window()``."""
        self.filled += nbytes
        self.last_bytes = self._loop.time()
        if self.filled >= self.size:
            self._finish()

    def feed(self, data: bytes) -> bool:
        """Body bytes the parser gave (those read with the head); True when too many
        wait for a buffer, and reading should pause."""
        self.last_bytes = self._loop.time()
        if self.buffer is None:
            self._early.append(data)
            self._early_bytes += len(data)
            return self._early_bytes > EARLY_LIMIT
        self._copy(data)
        return False

    def _copy(self, data: bytes) -> None:
        assert self.buffer is not None
        end = self.filled + len(data)  # (the parser gives no more than Content-Length)
        self.buffer[self.filled:end] = data
        self.filled = end
        if end >= self.size:
            self._finish()

    def attach(self, buffer: Buffer) -> None:
        """Receives the body into ``buffer`` (at least ``size`` bytes) from now on."""
        self.buffer = buffer
        transport = self._protocol.transport
        if self._expect_continue and not transport.is_closing():
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        early, self._early = self._early, []
        for piece in early:
            self._copy(piece)
        if self.filled >= self.size:
            self._finish()
        self._protocol.body_wanted()

    def fail(self, error: BaseException) -> None:
        if not self._done.done():
            self.error = error
            self._done.set_result(None)  # (a result: nobody may be waiting any more)

    def _finish(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    async def wait(self, idle_s: float) -> None:
        """Until the whole body is in the buffer; ``BodyTimeout`` when no byte came
        for ``idle_s``, ``ClientDisconnect`` when the connection went."""
        while not self._done.done():
            left = self.last_bytes + idle_s - self._loop.time()
            if left <= 0:
                raise BodyTimeout(f"chunk stalled: nothing arrived for {idle_s:.0f} s",
                                  seconds=idle_s)
            await asyncio.wait([self._done], timeout=left)
        if self.error is not None:
            raise self.error


class DirectBodyProtocol(GuardedProtocol):  # type: ignore[misc]
    """The guarded httptools protocol, which takes the bodies of chunk uploads
    straight into their buffers (through ``BufferedFront``)."""

    # The ASGI app of those requests (set by ``connection_protocol``).
    chunk_app: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sink: ChunkSink | None = None

    def _direct(self) -> str | None:
        """The method of a chunk request the lean route answers, or None."""
        if (self.chunk_app is None or self.limit_concurrency is not None
                or not CHUNK_PATH.fullmatch(self.url) or self.parser.should_upgrade()):
            return None
        method = self.parser.get_method()
        return "GET" if method == b"GET" else "PUT" if method == b"PUT" else None

    def _direct_size(self) -> int | None:
        """The body size of a chunk upload this connection takes straight into a
        buffer; None for any other."""
        size = None
        for name, value in self.headers:
            if name == b"content-length":
                if size is not None or not value.isdigit() or len(value) > 18:
                    return None
                size = int(value)
            elif name == b"transfer-encoding":
                return None
        return size if size is not None and size <= PREALLOCATE else None

    def on_headers_complete(self) -> None:
        method = self._direct()
        size = self._direct_size() if method == "PUT" else None
        if method == "GET" or size is not None:
            sink = None if size is None else ChunkSink(size, self)
            self.scope["extensions"] = {**self.scope.get("extensions", {}), DIRECT: sink}
            if sink is not None:
                self.sink = sink
                # Nothing more is read until the route has a buffer for it (it checks
                # the caller and the budget first: a refused body is not read).
                self.flow.pause_reading()
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if DIRECT in cycle.scope.get("extensions", {}) and app is self.app:
            app = self.chunk_app
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        if self.sink is None:
            super().on_body(body)
        elif self.sink.feed(body):
            self.flow.pause_reading()

    def on_message_complete(self) -> None:
        self.sink = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (resumes reading, starts a pipelined request)
        if self.sink is not None and self.sink.buffer is None and not self.transport.is_closing():
            # An upload pipelined behind the request just answered: its body waits
            # until the route has checked the caller and reserved its budget.
            self.flow.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.sink is not None:
            self.sink.fail(ClientDisconnect())
        super().connection_lost(exc)

    def body_wanted(self) -> None:
        """The route attached a buffer: reading goes on, into it. (A body the parser
        gave whole has been completed by the parser already.)"""
        if not self.transport.is_closing():
            self.flow.resume_reading()

    def body_window(self) -> memoryview | None:
        """Where the next read goes when it is a chunk body's; else None."""
        sink = self.sink
        return sink.window() if sink is not None and sink.receiving else None

    def body_received(self, nbytes: int) -> None:
        assert self.sink is not None
        self.sink.received(nbytes)
        if self.sink.complete:
            self._body_complete()

    def _body_complete(self) -> None:
        """The body was read past the parser, which still waits for it: a new parser
        starts at the next request, and the request is complete."""
        self.parser = httptools.HttpRequestParser(self)
        with suppress(AttributeError):  # (httptools < 0.6.3)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.on_message_complete()


class BufferedFront(asyncio.BufferedProtocol):
    """The transport's protocol: reads a chunk upload's body into its buffer,
    everything else into a shared read buffer whose bytes go on to the httptools
    protocol.

    In front of that protocol rather than a subclass of it: uvicorn's is an
    ``asyncio.Protocol``, and an event loop reads into a protocol's own buffers
    only for a protocol that is not one."""

    inner_class: type[DirectBodyProtocol] = DirectBodyProtocol

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = self.inner_class(*args, **kwargs)
        self._direct = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        self.inner.eof_received()
        return None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        window = self.inner.body_window()
        self._direct = window is not None
        return window if window is not None else _read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:
            self.inner.body_received(nbytes)
        else:
            self.inner.data_received(_read_buffer()[:nbytes].tobytes())


def connection_protocol(header_timeout: float, max_connections: int,
                        chunk_app: Callable[..., Any] | None,
                        send_timeout: float = 60.0) -> type[BufferedFront]:
    """The protocol class uvicorn serves with: the guarded httptools protocol with
    these limits, whose chunk uploads and reads ``chunk_app`` answers (None: every
    request goes through the application)."""
    inner = type("DirectBodyProtocol", (DirectBodyProtocol,), {
        "header_timeout": header_timeout, "max_connections": max_connections,
        "send_timeout": send_timeout,
        "waiting": OrderedDict(),
        # (in a staticmethod: a function set on a class would be called as a method)
        "chunk_app": None if chunk_app is None else staticmethod(chunk_app),
    })
    return type("BufferedFront", (BufferedFront,), {"inner_class": inner})
