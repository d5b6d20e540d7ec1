"""A chunk scrub found corrupt (and could not repair) is not deduplicated against:
a save that holds its bytes uploads them, the upload repairs the stored copy, and
the steps that named it are whole again. (Found by an operator's probe: the same
state saved again as a new step committed as ``latest`` with every chunk
deduplicated, on the corrupt copy, and its restore failed.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.hashing import chunk_id
from tests.cli_runs import ckptd

JOB = "llm"


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}


def _corrupt_one_chunk(store: Path) -> Path:
    path = sorted(p for p in (store / "chunks").rglob("*") if p.is_file())[0]
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _hashes_right(path: Path) -> bool:
    return chunk_id(path.read_bytes()) == path.name


@pytest.mark.parametrize("through", ["server", "file"])
def test_a_save_uploads_a_chunk_scrub_found_corrupt_and_repairs_its_steps(
        through: str, server: Any, shm: Path) -> None:
    url = server.url if through == "server" else f"file://{server.store}"
    with Checkpointer(url, JOB, shm_dir=str(shm)) as ckpt:
        ckpt.save(1, _state()).wait(60)
    bad = _corrupt_one_chunk(Path(server.store))
    scrubbed = ckptd("scrub", "--url", url)
    assert scrubbed.returncode == 1 and "damaged" in scrubbed.stdout, scrubbed

    with Checkpointer(url, JOB, shm_dir=str(shm)) as ckpt:
        saved = ckpt.save(2, _state()).wait(60)  # (the same bytes: every chunk stored)
    assert saved.state == "committed" and saved.chunks_sent == 1, saved
    assert _hashes_right(bad)  # the upload put good bytes in place of the corrupt ones
    for step in ("1", "2"):
        verified = ckptd("verify", JOB, step, "--url", url)
        assert verified.returncode == 0, verified
    listed = ckptd("ls", JOB, "--url", url)
    assert "damaged" not in listed.stdout, listed.stdout  # step 1 is whole again
    got: dict[str, Any] = {"w": torch.empty(64, 64), "b": torch.empty(64)}
    with Checkpointer(url, JOB, shm_dir=str(shm)) as ckpt:
        assert ckpt.restore(got).step == 2
    assert all(torch.equal(got[k], v) for k, v in _state().items())
