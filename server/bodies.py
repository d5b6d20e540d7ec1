"""Reading request bodies with a bound, so the server never holds more than one
body of a known maximum size per request."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from starlette.types import Message, Receive

from ckptd import knobs
from ckptd.errors import TooLarge
from ckptd.hashing import StreamingHasher

log = logging.getLogger(__name__)

# Hash an upload in stretches this long, off the event loop (blake3 releases the
# GIL), rather than piece by piece as the socket delivers it (~64 KiB).
HASH_STRETCH = 4 * knobs.MiB


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


async def read_chunk(request: Request) -> tuple[bytearray, str]:
    """A chunk upload's bytes and their blake3, hashed while they stream in.

    Refused with ``TooLarge`` as soon as the body passes ``knobs.MAX_CHUNK_SIZE``
    (or its Content-Length says it will)."""
    limit = knobs.MAX_CHUNK_SIZE
    _check_declared_length(request, limit, "chunk")
    body = bytearray()
    hasher = StreamingHasher()
    hashed = 0
    async for piece in request.stream():
        if len(body) + len(piece) > limit:
            raise TooLarge(f"chunk is over the limit of {limit} bytes", limit=limit)
        body += piece
        if len(body) - hashed >= HASH_STRETCH:
            await _hash_stretch(hasher, body, hashed)
            hashed = len(body)
    if hashed < len(body):
        await _hash_stretch(hasher, body, hashed)
    return body, hasher.hexdigest()


async def _hash_stretch(hasher: StreamingHasher, body: bytearray, start: int) -> None:
    # The views are released before the bytearray grows again (a bytearray with a
    # live export cannot be resized).
    with memoryview(body) as view, view[start:] as stretch:
        if len(stretch) >= knobs.MiB:
            await asyncio.to_thread(hasher.update, stretch)
        else:
            hasher.update(stretch)
