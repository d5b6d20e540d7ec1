"""The wire contract of ``POST /v1/chunks/read`` (docs/API.md): several chunks in
one answer, their bytes back to back and each one's size in a header. Beside
``ckptd.api`` (the other bodies), which it builds on."""

from __future__ import annotations

from pydantic import Field

from ckptd.api import _Request

__all__ = [
    "CHUNK_SIZES_HEADER",
    "MAX_CHUNK_READ",
    "MISSING_SIZE",
    "ChunkReadRequest",
    "chunk_sizes_header",
    "parse_chunk_sizes",
]


# Most chunk ids one ``POST /v1/chunks/read`` asks for: the answer holds them all.
MAX_CHUNK_READ = 64
# The answer's header: each asked chunk's size in bytes, in the order asked, with
# MISSING_SIZE for a chunk the caller does not get (not stored, not its job's, or
# past what one answer holds in memory: asked for again alone).
CHUNK_SIZES_HEADER = "X-Ckptd-Chunk-Sizes"
MISSING_SIZE = "-"


class ChunkReadRequest(_Request):
    ids: list[str] = Field(
        max_length=MAX_CHUNK_READ,
        description="Chunk ids (64 lowercase hex digits); the answer's body holds their "
        f"bytes back to back, in this order, and its {CHUNK_SIZES_HEADER} header each one's "
        f"size ('{MISSING_SIZE}' for one not sent).",
    )


def chunk_sizes_header(sizes: list[int | None]) -> str:
    """The ``X-Ckptd-Chunk-Sizes`` value of an answer (None: a chunk not sent)."""
    return ",".join(MISSING_SIZE if n is None else str(n) for n in sizes)


def parse_chunk_sizes(value: str, count: int) -> list[int | None]:
    """The sizes an ``X-Ckptd-Chunk-Sizes`` value gives for ``count`` chunks asked
    (None: not sent); ``ValueError`` when it does not give ``count`` sizes."""
    parts = value.split(",") if value else []
    if len(parts) != count:
        raise ValueError(f"{CHUNK_SIZES_HEADER} gives {len(parts)} sizes for {count} chunks")
    sizes: list[int | None] = []
    for part in parts:
        part = part.strip()
        if part == MISSING_SIZE:
            sizes.append(None)
        elif part.isdigit():
            sizes.append(int(part))
        else:
            raise ValueError(f"{CHUNK_SIZES_HEADER}: {part[:40]!r} is not a size")
    return sizes

