"""Reading request bodies with a bound, so the server never holds more than one
body of a known maximum size per request."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from fastapi import Request
from starlette.types import Message, Receive

from ckptd import knobs
from ckptd.errors import TooLarge
from ckptd.hashing import StreamingHasher

log = logging.getLogger(__name__)

# Hash an upload in stretches this long, off the event loop (blake3 releases the
# GIL), rather than piece by piece as the socket delivers it (~64 KiB).
HASH_STRETCH = 4 * knobs.MiB
# A Content-Length is believed this far before its bytes arrive; a longer body's
# buffer grows (doubling) as they do, so a request that only declares a huge body
# does not pin that much memory.
PREALLOCATE = 16 * knobs.MiB
# Idle body buffers kept for later uploads, in bytes, and for how long.
BUFFERS_KEEP = 64 * knobs.MiB
BUFFERS_IDLE_S = 30.0


def json_body_limit() -> int:
    """Bytes of a FastAPI-parsed JSON body: what the largest legal missing-chunks
    call needs (a quoted 64-hex-digit id, a comma and some indentation per id),
    at least 1 MiB."""
    return max(knobs.MiB, knobs.missing_batch() * 80 + 64 * 1024)


def _check_declared_length(request: Request, limit: int, what: str) -> None:
    declared = request.headers.get("content-length", "")
    # (uvicorn refuses a Content-Length that is not a number; the length check
    # on the digits keeps int() away from absurdly long ones)
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise TooLarge(f"{what} of {declared[:20]} bytes is over the limit of {limit}", limit=limit)


def bounded(request: Request, limit: int, what: str = "request body") -> Request:
    """The same request, whose body raises ``TooLarge`` once it passes ``limit``."""
    _check_declared_length(request, limit, what)
    receive: Receive = request.receive
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise TooLarge(f"{what} is over the limit of {limit} bytes", limit=limit)
        return message

    return Request(request.scope, limited)


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The whole body, refused with ``TooLarge`` as soon as it passes ``limit``."""
    return await bounded(request, limit, what).body()


class BodyBuffers:
    """Chunk-body buffers that outlive their upload, for a later upload of the same
    size: a fresh buffer costs a page fault per 4 KiB and a zero fill, which were
    about a sixth of the server's CPU under a large upload. Buffers of at least
    ``smallest`` bytes are kept, at most ``keep`` bytes of them, none longer than
    ``idle_s`` once uploads stop."""

    def __init__(self, keep: int, idle_s: float, smallest: int = knobs.MiB) -> None:
        self.keep = keep
        self.idle_s = idle_s
        self.smallest = smallest
        self._idle: list[bytearray] = []  # oldest first: who goes when over ``keep``
        self._last_give = 0.0
        self._trim_loop: asyncio.AbstractEventLoop | None = None  # where the trim waits
        # Tests serve several apps, on several loops, in one process.
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(buf) for buf in self._idle)

    def take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes: an idle one if there is one."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # the newest is the warmest
                if len(self._idle[i]) == size:
                    return self._idle.pop(i)
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Keeps ``buf`` for a later upload. Only once nothing reads it any more: a
        store that was still writing it would store another upload's bytes."""
        if not self.smallest <= len(buf) <= self.keep:
            return
        with self._lock:
            self._idle.append(buf)
            held = sum(len(b) for b in self._idle)
            while held > self.keep:
                held -= len(self._idle.pop(0))
            self._last_give = time.monotonic()
            if self._trim_loop is None or self._trim_loop.is_closed():
                self._trim_loop = asyncio.get_running_loop()
                self._trim_loop.call_later(self.idle_s, self._expire)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()

    def _expire(self) -> None:
        with self._lock:
            wait = self._last_give + self.idle_s - time.monotonic()
            if wait > 0:
                asyncio.get_running_loop().call_later(wait, self._expire)
                return
            self._trim_loop = None
            self._idle.clear()


BUFFERS = BodyBuffers(BUFFERS_KEEP, BUFFERS_IDLE_S)


@dataclass(frozen=True, slots=True)
class ChunkBody:
    """An upload's bytes: the first ``size`` of ``buffer``, which hash to ``digest``."""

    buffer: bytearray
    size: int
    digest: str


async def read_chunk(request: Request) -> ChunkBody:
    """A chunk upload's bytes and their blake3, hashed while they stream in.

    Refused with ``TooLarge`` as soon as the body passes ``knobs.MAX_CHUNK_SIZE``
    (or its Content-Length says it will). Give the buffer back to ``BUFFERS`` once
    the chunk is stored."""
    limit = knobs.MAX_CHUNK_SIZE
    _check_declared_length(request, limit, "chunk")
    declared = request.headers.get("content-length", "")
    expected = int(declared) if declared.isdigit() else None
    # One buffer, filled in place: growing a bytearray by each piece as it arrives
    # (~200 KiB) copies the body over and over as it reallocates.
    if expected is None:  # chunked transfer encoding: the buffer grows as bytes arrive
        body = bytearray()
    elif expected <= PREALLOCATE:
        body = BUFFERS.take(expected)
    else:
        body = bytearray(PREALLOCATE)
    ceiling = limit if expected is None else expected
    filled = 0
    hasher = StreamingHasher()
    hashed = 0
    async for piece in request.stream():
        end = filled + len(piece)
        if end > limit:
            raise TooLarge(f"chunk is over the limit of {limit} bytes", limit=limit)
        if end > len(body):  # doubling: each byte is copied about once more at most
            grown = max(end, min(2 * len(body), ceiling))
            body.extend(bytes(grown - len(body)))
        body[filled:end] = piece
        filled = end
        if filled - hashed >= HASH_STRETCH:
            await _hash_stretch(hasher, body, hashed, filled)
            hashed = filled
    if hashed < filled:
        await _hash_stretch(hasher, body, hashed, filled)
    return ChunkBody(body, filled, hasher.hexdigest())


async def _hash_stretch(hasher: StreamingHasher, body: bytearray, start: int, end: int) -> None:
    # The views are released before the bytearray grows (a bytearray with a live
    # export cannot be resized).
    with memoryview(body) as view, view[start:end] as stretch:
        if len(stretch) >= knobs.MiB:
            await asyncio.to_thread(hasher.update, stretch)
        else:
            hasher.update(stretch)
