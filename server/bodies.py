"""Reading request bodies with a bound, so the server never holds more than one
body of a known maximum size per request."""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.types import Message, Receive

from ckptd import knobs
from ckptd.errors import (
    BodyTimeout,
    CkptdError,
    InvalidRequest,
    TooLarge,
    Unavailable,
    UnsupportedMediaType,
)
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

# A chunk body's buffer: a map (page-aligned) from BodyBuffers, a bytearray else.
Buffer = bytearray | mmap.mmap


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


def check_json_type(request: Request, *, required: bool = True) -> None:
    """Refuses (415) a JSON body sent as another media type: JSON is ``application/json``
    or ``application/*+json`` (parameters aside). One sent with no Content-Type at all
    is refused only when ``required``: a form or text/plain POST is what a browser
    sends another site without asking first, and none of our clients sends one."""
    sent = request.headers.get("content-type", "")
    media = sent.partition(";")[0].strip().lower()
    if not media and not required:
        return
    if media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")):
        came = f"not {sent[:80]!r}" if media else "it came with none"
        raise UnsupportedMediaType(
            f"this body is JSON: send it as Content-Type: application/json ({came})",
            content_type=sent[:80])


class _NotANumber(ValueError):
    """NaN, Infinity or -Infinity where JSON has a number."""


def _refuse_constant(name: str) -> Any:
    raise _NotANumber(name)


def refuse_non_finite(body: bytes) -> None:
    """Refuses (400) a JSON body holding ``NaN``, ``Infinity`` or ``-Infinity``:
    Python's parser (FastAPI's) reads them, JSON has no such numbers, and the
    documents refuse them too (``ckptd.large_json``). Parsed a second time only when
    those letters are in it at all: few bodies pay for the check."""
    if b"NaN" not in body and b"Infinity" not in body:
        return
    try:
        json.loads(body, parse_constant=_refuse_constant)
    except _NotANumber as exc:
        raise InvalidRequest(
            f"the request body is not valid JSON: {exc} is no JSON number (send a "
            "finite number, or null)", constant=str(exc)) from None
    except (ValueError, RecursionError):
        return  # (not JSON at all: FastAPI's parse says so, as for any other body)


def body_timeout(request: Request) -> float:
    """Seconds a body may go without a byte (``Settings.body_timeout``)."""
    settings = getattr(request.app.state, "settings", None)
    return float(getattr(settings, "body_timeout", 60.0))


def timed(receive: Receive, seconds: float, what: str) -> Receive:
    """``receive`` that raises ``BodyTimeout`` when nothing arrives for ``seconds``:
    a stalled upload must not hold its memory and its connection for ever."""

    async def within() -> Message:
        try:
            return await asyncio.wait_for(receive(), seconds)
        except TimeoutError:
            raise BodyTimeout(f"{what} stalled: nothing arrived for {seconds:.0f} s",
                              seconds=seconds) from None

    return within


def bounded(request: Request, limit: int, what: str = "request body") -> Request:
    """The same request, whose body raises ``TooLarge`` once it passes ``limit``
    and ``BodyTimeout`` when it stalls."""
    _check_declared_length(request, limit, what)
    receive: Receive = timed(request.receive, body_timeout(request), what)
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
        self._idle: list[Buffer] = []  # oldest first: who goes when over ``keep``
        self._last_give = 0.0
        self._trim_loop: asyncio.AbstractEventLoop | None = None  # where the trim waits
        # Tests serve several apps, on several loops, in one process.
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(buf) for buf in self._idle)

    def take(self, size: int) -> Buffer:
        """A buffer of exactly ``size`` bytes: an idle one if there is one. One of
        ``smallest`` bytes or more starts on a page (an anonymous map), so that the
        store can write it around the page cache (``ckptd.store.direct_io``)."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # the newest is the warmest
                if len(self._idle[i]) == size:
                    return self._idle.pop(i)
        if size < self.smallest:
            return bytearray(size)
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # (anonymous: fd -1)

    def give(self, buf: Buffer) -> None:
        """Keeps ``buf`` for a later upload. Only once nothing reads it any more: a
        store that was still writing it would store another upload's bytes."""
        if not self.smallest <= len(buf) <= self.keep or not isinstance(buf, mmap.mmap):
            return  # (a bytearray of a grown body: a later take makes an aligned map)
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


async def wait_for_room(room: Callable[[], bool], wait_s: float,
                        refusal: Callable[[], CkptdError]) -> None:
    """Calls ``room`` until it is True, for ``wait_s`` at most, then raises
    ``refusal()``. Polling (with a growing pause) rather than a condition: tests
    serve apps on several loops in one process, and a wait for room is short."""
    deadline = time.monotonic() + wait_s
    pause = 0.005
    while not room():
        if time.monotonic() >= deadline:
            raise refusal()
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)


class IngestBudget:
    """Bytes of upload bodies held at once, by every upload together: a request
    reserves what its Content-Length declares before a buffer exists, waits up to
    ``wait_s`` while the budget is spent, then is refused (503, retry later). So
    50 uploads that only declare 16 MiB each pin the budget, not 800 MiB."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self._lock = threading.Lock()

    def _try(self, nbytes: int) -> bool:
        with self._lock:
            # One request larger than the whole budget may still go alone.
            if self.held + nbytes <= self.capacity or self.held == 0:
                self.held += nbytes
                return True
            return False

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        await wait_for_room(lambda: self._try(nbytes), self.wait_s, lambda: Unavailable(
            f"the server holds {self.held} bytes of uploads (its budget is "
            f"{self.capacity}); try again shortly", retry_after_s=1,
        ))
        try:
            yield
        finally:
            self.release(nbytes)


def declared_chunk_bytes(request: Request) -> int:
    """What a chunk upload will hold: its Content-Length, or the most a chunk may be."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and len(declared) <= 18:
        return min(int(declared), knobs.MAX_CHUNK_SIZE)
    return knobs.MAX_CHUNK_SIZE


def declared_body_bytes(request: Request, limit: int) -> int:
    """What a body read whole will hold: its Content-Length, or ``limit`` at most."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and len(declared) <= 18:
        return min(int(declared), limit)
    return limit


def ingest_budget(request: Request) -> IngestBudget:
    """The budget of this application's uploads (``Settings.ingest_budget``)."""
    settings = getattr(request.app.state, "settings", None)
    capacity = int(getattr(settings, "ingest_budget", 1 << 30))
    wait_s = float(getattr(settings, "ingest_wait", 10.0))
    budget = getattr(request.app.state, "ingest", None)
    if not isinstance(budget, IngestBudget):
        budget = IngestBudget(capacity, wait_s)
        request.app.state.ingest = budget
    return budget


@dataclass(frozen=True, slots=True)
class ChunkBody:
    """An upload's bytes: the first ``size`` of ``buffer``, which hash to ``digest``
    (None: not hashed yet; the store's put hashes them, ``Repository.put_chunk``)."""

    buffer: Buffer
    size: int
    digest: str | None


async def read_chunk(request: Request) -> ChunkBody:
    """A chunk upload's bytes and their blake3, hashed while they stream in.

    Refused with ``TooLarge`` as soon as the body passes ``knobs.MAX_CHUNK_SIZE``
    (or its Content-Length says it will). Give the buffer back to ``BUFFERS`` once
    the chunk is stored."""
    limit = knobs.MAX_CHUNK_SIZE
    _check_declared_length(request, limit, "chunk")
    request = Request(request.scope, timed(request.receive, body_timeout(request), "chunk"))
    declared = request.headers.get("content-length", "")
    expected = int(declared) if declared.isdigit() else None
    # One buffer, filled in place: growing a bytearray by each piece as it arrives
    # (~200 KiB) copies the body over and over as it reallocates.
    body: Buffer
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
            if not isinstance(body, bytearray):  # (a map cannot grow)
                body = bytearray(body)
            body.extend(bytes(grown - len(body)))
        body[filled:end] = piece
        filled = end
        if filled - hashed >= HASH_STRETCH:
            await _hash_stretch(hasher, body, hashed, filled)
            hashed = filled
    if hashed < filled:
        await _hash_stretch(hasher, body, hashed, filled)
    return ChunkBody(body, filled, hasher.hexdigest())


async def _hash_stretch(hasher: StreamingHasher, body: Buffer, start: int, end: int) -> None:
    # The views are released before the bytearray grows (a bytearray with a live
    # export cannot be resized).
    with memoryview(body) as view, view[start:end] as stretch:
        if len(stretch) >= knobs.MiB:
            await asyncio.to_thread(hasher.update, stretch)
        else:
            hasher.update(stretch)
