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
from ckptd.errors import MissingChunks
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


@pytest.mark.parametrize("through", ["server", "file"])
def test_a_step_naming_a_chunk_marked_meanwhile_is_not_committed_and_the_next_repairs(
        through: str, server: Any, shm: Path) -> None:
    """Another process's scrub (here ``ckptd scrub`` on the store itself) marks a
    chunk after the server last read the markers: the next save is told the chunk
    is there and sends nothing, but its commit reads the job's markers, finds the
    chunk still corrupt and refuses the step; the save after sends it."""
    url = server.url if through == "server" else f"file://{server.store}"
    with Checkpointer(url, JOB, shm_dir=str(shm)) as ckpt:
        ckpt.save(1, _state()).wait(60)
        bad = _corrupt_one_chunk(Path(server.store))
        scrubbed = ckptd("scrub", "--url", str(server.store))
        assert scrubbed.returncode == 1 and "damaged" in scrubbed.stdout, scrubbed
        with pytest.raises(MissingChunks, match="scrub found corrupt"):
            ckpt.save(2, _state()).wait(60)
        saved = ckpt.save(3, _state()).wait(60)
    assert saved.state == "committed" and saved.chunks_sent == 1, saved
    assert _hashes_right(bad)
    listed = ckptd("ls", JOB, "--url", url)
    assert listed.returncode == 0 and "damaged" not in listed.stdout, listed.stdout
    rows = {cells[0]: cells[1] for line in listed.stdout.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) > 2}
    assert rows == {"1": "committed", "2": "not committed", "3": "committed"}, listed.stdout
