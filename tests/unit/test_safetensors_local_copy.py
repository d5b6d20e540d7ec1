"""The export's copy of a chunk file on this host (``_copy_verified``): a piece at a
time through a small buffer, hashed as it goes, and said to be wrong (for another
tier to write again) when the file is not the chunk, wherever the damage lies."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")

from ckptd.client.integrations.safetensors.export import _Chunk, _copy_verified  # noqa: E402
from ckptd.hashing import chunk_id  # noqa: E402
from ckptd.knobs import MiB  # noqa: E402

SIZE = 2 * MiB + 12345  # three pieces of a 1 MiB buffer, the last one short


def chunk_file(folder: Path, data: bytes) -> Path:
    path = folder / "chunk"
    path.write_bytes(data)
    return path


def copy(path: Path, cid: str, size: int, out: Path, offset: int) -> bool:
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        return _copy_verified(path, _Chunk(cid, "t", 0, size), fd, offset,
                              memoryview(bytearray(MiB)))
    finally:
        os.close(fd)


def test_a_chunk_file_is_copied_whole_at_its_offset(tmp_path: Path) -> None:
    data = np.random.default_rng(0).bytes(SIZE)
    out = tmp_path / "out"
    assert copy(chunk_file(tmp_path, data), chunk_id(data), SIZE, out, 4096)
    written = out.read_bytes()
    assert written[:4096] == bytes(4096) and written[4096:] == data


@pytest.mark.parametrize("where", [0, MiB + 7, SIZE - 1])
def test_a_damaged_byte_in_any_piece_is_caught(tmp_path: Path, where: int) -> None:
    data = np.random.default_rng(1).bytes(SIZE)
    bad = bytearray(data)
    bad[where] ^= 0x01
    assert not copy(chunk_file(tmp_path, bytes(bad)), chunk_id(data), SIZE,
                    tmp_path / "out", 0)


def test_a_file_of_another_size_or_gone_is_not_the_chunk(tmp_path: Path) -> None:
    data = np.random.default_rng(2).bytes(SIZE)
    path = chunk_file(tmp_path, data)
    assert not copy(path, chunk_id(data), SIZE + 1, tmp_path / "out", 0)
    assert not copy(tmp_path / "gone", chunk_id(data), SIZE, tmp_path / "out", 0)


def test_a_failed_write_of_the_export_is_raised_not_taken_for_a_bad_chunk(
        tmp_path: Path) -> None:
    # (Found by review.) A full disk or a closed file is the export's own failure: it
    # must not send the chunk to other tiers as if the file here were damaged.
    data = np.random.default_rng(3).bytes(SIZE)
    path = chunk_file(tmp_path, data)
    out = tmp_path / "out"
    out.write_bytes(b"")
    fd = os.open(out, os.O_RDONLY)  # a write to it fails (EBADF)
    try:
        with pytest.raises(OSError):
            _copy_verified(path, _Chunk(chunk_id(data), "t", 0, SIZE), fd, 0,
                           memoryview(bytearray(MiB)))
    finally:
        os.close(fd)
