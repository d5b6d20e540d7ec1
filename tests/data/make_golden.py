"""Writes the golden store of format version 1 (``tests/data/golden-v1``).

Run once, and commit what it writes::

    python tests/data/make_golden.py            # into tests/data/golden-v1
    python tests/data/make_golden.py OUT_DIR    # anywhere else

Everything in it is deterministic (fixed bytes, a fixed clock), so running it again
gives the same files byte for byte; ``tests/unit/test_golden.py`` checks that, and
that today's code reads the committed copy. Do not regenerate the committed copy to
make that test pass: a difference means the on-store format changed, which needs a
new format version (``docs/FORMAT.md``, "Changes").

The job ``golden`` has two ranks (data parallel on one tensor, sharded on another):

- ``model.embed.weight``: float32 [40, 64], replicated on both ranks (10240 bytes:
  three chunks of 4096, 4096, 2048); step 2 changes only its last row, so its first
  two chunks are shared with step 1
- ``model.layers.0.mlp.weight``: bfloat16 [96, 48], sharded by rows, rank r holds
  rows 48r..48r+47 (4608 bytes each: chunks of 4096 and 512)
- ``rng_state``: int64 [4], local to each rank
- a tree with nested dicts, an integer key, a list, a tuple, NaN and inf floats,
  None, strings, bools and ints

Steps 1 and 2 are committed (``latest`` is 2); step 3 has only rank 0's manifest:
pending, never latest.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

from ckptd.format import RankManifest, TensorEntry
from ckptd.hashing import chunk_id, chunk_spans
from ckptd.repository import Repository
from ckptd.store.local import LocalStore

JOB = "golden"
WORLD_SIZE = 2
CHUNK_SIZE = 4096
COMMITTED_AT = 1700000000.0
COMMITTED_STEPS = (1, 2)
PENDING_STEP = 3  # rank 0 only
HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden-v1"

EMBED = "model.embed.weight"  # float32 [40, 64], replicated
MLP = "model.layers.0.mlp.weight"  # bfloat16 [96, 48], sharded by rows
RNG = "rng_state"  # int64 [4], local
EMBED_SHAPE = [40, 64]
MLP_SHAPE = [96, 48]
MLP_ROWS_PER_RANK = MLP_SHAPE[0] // WORLD_SIZE


def embed_bytes(step: int) -> bytes:
    """Little-endian float32 in C order; step 2 differs from step 1 in the last row."""
    rows, cols = EMBED_SHAPE
    values = []
    for i in range(rows):
        for j in range(cols):
            v = ((i * cols + j) % 97) * 0.25 - 12.0
            if i == rows - 1:
                v += step
            values.append(v)
    return struct.pack(f"<{len(values)}f", *values)


def bfloat16(value: float) -> bytes:
    """The bfloat16 nearest below ``value``: the high half of its float32 bits."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.pack("<H", bits >> 16)


def mlp_bytes(step: int, rank: int) -> bytes:
    """Rank ``rank``'s rows of the sharded bfloat16 tensor, little-endian, C order."""
    cols = MLP_SHAPE[1]
    first = rank * MLP_ROWS_PER_RANK
    out = bytearray()
    for i in range(first, first + MLP_ROWS_PER_RANK):
        for j in range(cols):
            out += bfloat16((((i * cols + j) * 7 + step) % 251 - 125) / 8.0)
    return bytes(out)


def rng_bytes(step: int, rank: int) -> bytes:
    """A rank's own int64 state, little-endian; negative values included."""
    return struct.pack("<4q", 1234 + rank, -rank - 1, step, 0x0123456789ABCDEF)


def tensor_bytes(name: str, step: int, rank: int) -> bytes:
    """The bytes a rank holds for an entry at a step: what a reader must get back."""
    if name == EMBED:
        return embed_bytes(step)
    if name == MLP:
        return mlp_bytes(step, rank)
    if name == RNG:
        return rng_bytes(step, rank)
    raise KeyError(name)


def tree(step: int) -> dict[str, Any]:
    return {
        "dict": [
            ["model", {"dict": [
                ["embed.weight", {"tensor": EMBED}],
                ["layers.0.mlp.weight", {"tensor": MLP}],
            ]}],
            ["optimizer", {"dict": [
                ["state", {"dict": [
                    [0, {"dict": [["step", {"value": step}], ["exp_avg_norm", {"value": 0.125}]]}],
                ]}],
                ["param_groups", {"list": [{"dict": [
                    ["lr", {"value": 0.001}],
                    ["betas", {"tuple": [{"value": 0.9}, {"value": 0.999}]}],
                    ["amsgrad", {"value": False}],
                    ["params", {"list": [{"value": 0}]}],
                ]}]}],
            ]}],
            ["rng_state", {"tensor": RNG}],
            ["scheduler", {"dict": [
                ["last_epoch", {"value": step * 10}],
                ["best", {"float": "nan"}],
                ["worst", {"float": "-inf"}],
                ["patience_left", {"float": "inf"}],
                ["mode", {"value": "min"}],
                ["note", {"value": "héllo, wörld"}],
                ["cooldown", {"value": None}],
            ]}],
            ["step", {"value": step}],
        ]
    }


def chunks_of(data: bytes) -> list[tuple[str, bytes]]:
    return [(chunk_id(data[a:b]), data[a:b]) for a, b in chunk_spans(len(data), CHUNK_SIZE)]


def rank_manifest(step: int, rank: int) -> tuple[RankManifest, dict[str, bytes]]:
    chunks: dict[str, bytes] = {}

    def entry(name: str, dtype: str, placement: Any, global_shape: list[int],
              offsets: list[int], shape: list[int]) -> TensorEntry:
        data = tensor_bytes(name, step, rank)
        pieces = chunks_of(data)
        chunks.update(pieces)
        return TensorEntry(
            name=name, dtype=dtype, placement=placement, global_shape=global_shape,
            offsets=offsets, shape=shape, nbytes=len(data), chunks=[c for c, _ in pieces],
        )

    rows = MLP_ROWS_PER_RANK
    entries = [
        entry(EMBED, "float32", "replicated", EMBED_SHAPE, [0, 0], EMBED_SHAPE),
        entry(MLP, "bfloat16", "sharded", MLP_SHAPE, [rank * rows, 0], [rows, MLP_SHAPE[1]]),
        entry(RNG, "int64", "local", [4], [0], [4]),
    ]
    manifest = RankManifest(
        job=JOB, step=step, rank=rank, world_size=WORLD_SIZE, chunk_size=CHUNK_SIZE,
        entries=entries, tree=tree(step), meta={"producer": "tests/data/make_golden.py"},
    )
    manifest.check()
    return manifest, chunks


async def _write(out: Path) -> None:
    repo = Repository(LocalStore(out, fsync=False), clock=lambda: COMMITTED_AT)
    plan = [(s, r) for s in COMMITTED_STEPS for r in range(WORLD_SIZE)] + [(PENDING_STEP, 0)]
    for step, rank in plan:
        manifest, chunks = rank_manifest(step, rank)
        for cid in (await repo.missing_chunks(sorted(chunks))).missing:
            await repo.put_chunk(cid, chunks[cid])
        await repo.put_manifest(manifest)
        status = await repo.commit(JOB, step, meta={"reason": "golden"})
        assert status.state == ("pending" if (step, rank) == (PENDING_STEP, 0) or rank == 0
                                else "committed"), status
    await repo.close()


def generate(out: Path) -> None:
    """Writes the golden store into ``out``, which must not exist or be empty."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; remove it first")
    asyncio.run(_write(out))
    # The local store's ref locks are its own business, not part of the format.
    shutil.rmtree(out / ".locks", ignore_errors=True)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_DIR)
