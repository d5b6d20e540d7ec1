"""blake3 chunk ids and fixed-offset chunking."""

from __future__ import annotations

from collections.abc import Iterator

import blake3

from ckptd import knobs

Buffer = bytes | bytearray | memoryview


def chunk_id(data: Buffer) -> str:
    """Lowercase hex blake3 of ``data``; large buffers use blake3's own threads
    (it releases the GIL while it hashes)."""
    threads = blake3.blake3.AUTO if len(data) >= knobs.hash_threads_threshold() else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def document_hash(data: bytes) -> str:
    """The blake3 of a canonical JSON document (a manifest, a commit record)."""
    return blake3.blake3(data).hexdigest()


def chunk_spans(nbytes: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """(start, end) byte offsets of the fixed-size chunks of an ``nbytes`` buffer.

    Offsets are fixed multiples of ``chunk_size``, so an unchanged region of a
    tensor keeps its chunk ids from one step to the next."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    for start in range(0, nbytes, chunk_size):
        yield start, min(start + chunk_size, nbytes)


def chunk_count(nbytes: int, chunk_size: int) -> int:
    return (nbytes + chunk_size - 1) // chunk_size


class StreamingHasher:
    """Hashes a body as it streams in, counting its bytes."""

    def __init__(self) -> None:
        self._hasher = blake3.blake3()
        self.size = 0

    def update(self, data: Buffer) -> None:
        self._hasher.update(data)
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()
