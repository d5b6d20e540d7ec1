"""Writes the golden staging pool of pool format version 1 (``tests/data/golden-pool-v1``).

Run once, and commit what it writes::

    python tests/data/make_golden_pool.py            # into tests/data/golden-pool-v1
    python tests/data/make_golden_pool.py OUT_DIR    # anywhere else

It is what a worker of job ``golden``, rank 0, leaves in ``/dev/shm`` when it dies
after its snapshot of step 1 was staged and hashed (the files of
``<shm>/ckptd-<uid>/golden/rank-0/``), with fixed bytes, pid 0 and a fixed segment
name, so running it again gives the same files byte for byte.
``tests/unit/test_staging_format.py`` checks that, that today's reader reads the
committed copy, and that today's writer (``StagingPool``) lays out and indexes the
same tensors the same way. Do not regenerate the committed copy to make that test
pass: a difference means the pool format changed, which needs a new pool version
(docs/FORMAT.md, "Staging pool").

The pool holds two tensors staged whole in one segment, with 4096-byte chunks:

- ``model.w``: float32 [3, 700] (8400 bytes: chunks of 4096, 4096, 208) at offset 0
- ``model.b``: bfloat16 [5] (10 bytes: one chunk) at offset 8448 (64-byte aligned)
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from ckptd.client.staging.format import (
    CONTROL_NAME,
    INDEX_NAME,
    ControlHeader,
    PoolIndex,
    SegmentRecord,
    SpanRecord,
)
from ckptd.hashing import chunk_id, chunk_spans

HERE = Path(__file__).resolve().parent
GOLDEN_POOL_DIR = HERE / "golden-pool-v1"
JOB = "golden"
RANK = 0
STEP = 1
CHUNK_SIZE = 4096
GENERATION = 2  # a fresh pool's first stage: 0 -> 1 (copying) -> 2 (copied)
SEGMENT = "seg-golden-0"
SEGMENT_BYTES = 12288
W, W_SHAPE = "model.w", (3, 700)
B, B_SHAPE = "model.b", (5,)
B_OFFSET = 8448


def w_bytes() -> bytes:
    """float32 values i / 8 for i in 0..2099, little-endian."""
    n = W_SHAPE[0] * W_SHAPE[1]
    return struct.pack(f"<{n}f", *(i / 8 for i in range(n)))


def b_bytes() -> bytes:
    """bfloat16 1.0, -2.0, 0.5, 3.0, -0.25 (the high halves of their float32s)."""
    values = (1.0, -2.0, 0.5, 3.0, -0.25)
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def chunk_ids(data: bytes) -> tuple[str, ...]:
    return tuple(chunk_id(data[a:b]) for a, b in chunk_spans(len(data), CHUNK_SIZE))


def golden_index() -> PoolIndex:
    w, b = w_bytes(), b_bytes()
    return PoolIndex(
        job=JOB, rank=RANK, pid=0, state="staged", step=STEP, generation=GENERATION,
        chunk_size=CHUNK_SIZE, piece=(0, 1),
        segments=(SegmentRecord(SEGMENT, SEGMENT_BYTES, True),),
        entries=(
            SpanRecord(W, "float32", W_SHAPE, len(w), 0, len(w), 0, SEGMENT, 0, chunk_ids(w)),
            SpanRecord(B, "bfloat16", B_SHAPE, len(b), 0, len(b), 0, SEGMENT, B_OFFSET,
                       chunk_ids(b)),
        ),
    )


def golden_files() -> dict[str, bytes]:
    """File name -> bytes of the golden pool directory."""
    segment = bytearray(SEGMENT_BYTES)
    w, b = w_bytes(), b_bytes()
    segment[0 : len(w)] = w
    segment[B_OFFSET : B_OFFSET + len(b)] = b
    return {
        CONTROL_NAME: ControlHeader(generation=GENERATION, pid=0).pack(),
        INDEX_NAME: golden_index().encode(),
        SEGMENT: bytes(segment),
    }


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in golden_files().items():
        (out / name).write_bytes(data)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_POOL_DIR)
