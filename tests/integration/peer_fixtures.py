"""Fixtures of the tests whose ranks run as processes of their own
(``restore_peer.py``) and restore from one another: a test module imports them by
their function names and asks for them as ``shm`` and ``srv``."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess
from tests.integration.restore_peer import TOKEN


@pytest.fixture(name="shm")
def exported_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private staging root for this test and the processes it starts
    (``CKPTD_SHM_DIR``)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"ckptd-test-{secrets.token_hex(4)}"
    root.mkdir()
    monkeypatch.setenv("CKPTD_SHM_DIR", str(root))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(name="srv")
def peer_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    """A server with the peers' token; this test's heartbeats every 0.2 s, so that
    the server knows the peers' pools at once."""
    monkeypatch.setenv("CKPTD_HEARTBEAT_INTERVAL", "0.2")
    server = ServerProcess(store=tmp_path / "store", token=TOKEN)
    server.start()
    try:
        yield server
    finally:
        server.stop()
