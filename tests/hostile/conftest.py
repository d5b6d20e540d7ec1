"""One server per module: hostile tests are many small requests, and a server
start costs a second or two on a busy machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root: Path = tmp_path_factory.mktemp("hostile")
    srv = ServerProcess(store=root / "store")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, timeout=30.0) as c:
        yield c
