"""What a load checks of a pointer file, as a fresh user's probe met it: a pointer
saved through one ckptd server loaded the same-named job's step of another with
no word, and a pointer of a version this code does not know loaded too."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from ckptd.errors import InvalidRequest
from tests.conftest import ServerProcess

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("lightning", reason="pip install 'ckptd[lightning]'")

from ckptd.client.integrations.lightning import CkptdCheckpointIO, read_pointer  # noqa: E402
from tests.integration.lightning_fixtures import (  # noqa: E402,F401 - *_fixture: found by pytest
    io_fixture,
    small_checkpoint,
    store_fixture,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _save(url: str, shm: Path, path: Path, step: int, seed: int) -> None:
    io = CkptdCheckpointIO(url, job="lt1", shm_dir=str(shm))
    try:
        io.save_checkpoint(small_checkpoint(step, seed=seed), path)
    finally:
        io.teardown()


def test_a_pointer_of_another_server_is_refused(server: ServerProcess, shm: Path,
                                                tmp_path: Path) -> None:
    """Server 2 holds a job of the same name: its step was loaded through server 1's
    pointer. The pointer keeps the id of the store it was saved to; one store under
    another URL of the same server is the same store."""
    other = ServerProcess(store=tmp_path / "store2")
    other.start()
    try:
        _save(server.url, shm, tmp_path / "ckpts" / "last.ckpt", 12, seed=1)
        _save(other.url, shm, tmp_path / "other" / "last.ckpt", 12, seed=2)
        io = CkptdCheckpointIO(other.url, job="lt1", shm_dir=str(shm))
        try:
            with pytest.raises(InvalidRequest) as err:
                io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
        finally:
            io.teardown()
        message = err.value.message
        assert "\n" not in message and "another store" in message, message
        assert f"CkptdCheckpointIO({server.url!r}, job='lt1')" in message, message
        doc = read_pointer(tmp_path / "ckpts" / "last.ckpt")
        assert doc is not None and isinstance(doc["store_id"], str)
        same = server.url.replace("127.0.0.1", "localhost")
        io = CkptdCheckpointIO(same, job="lt1", shm_dir=str(shm))
        try:
            got = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
        finally:
            io.teardown()
        assert torch.equal(got["state_dict"]["weight"],
                           small_checkpoint(12, seed=1)["state_dict"]["weight"])
    finally:
        other.stop()


def test_a_pointer_without_a_store_id_of_another_url_loads_with_a_warning(
        io: CkptdCheckpointIO, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pointer written before the store's id was kept (or of a store without one)
    names its store by the URL only: one of another URL (a server that moved, or
    another server) loads, said in a warning with the way to load it from there; it
    loaded without a word before today, and a refusal would break a run resumed
    after its server moved (review)."""
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(small_checkpoint(4), path)
    io.teardown()
    doc = json.loads(path.read_text())
    doc.pop("store_id", None)
    path.write_text(json.dumps({**doc, "url": "http://127.0.0.1:9/"}))
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        assert io.load_checkpoint(path)["global_step"] == 4
    said = [r.getMessage() for r in caplog.records if "this plugin's url" in r.getMessage()]
    assert len(said) == 1 and "CkptdCheckpointIO('http://127.0.0.1:9/')" in said[0], said
    caplog.clear()
    path.write_text(json.dumps({**doc, "url": io.url}))
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        assert io.load_checkpoint(path)["global_step"] == 4
    assert not [r for r in caplog.records if "this plugin's url" in r.getMessage()]


def test_a_pointer_of_an_unknown_version_is_refused_in_a_line(io: CkptdCheckpointIO,
                                                              tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(small_checkpoint(4), path)
    io.teardown()
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "version": 7}))
    with pytest.raises(InvalidRequest, match="pointer of version 7, which this ckptd does "
                                             "not know") as err:
        io.load_checkpoint(path)
    assert "\n" not in err.value.message
