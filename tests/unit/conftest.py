"""Fixtures the repository's unit tests share: each runs on the memory store and on
a local directory store (a test module may define its own ``store`` or ``repo``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.repository import Repository
from ckptd.store import LocalStore, MemoryStore
from ckptd.store.base import Store


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "memory":
        return MemoryStore()
    return LocalStore(tmp_path / "store", fsync=False)


@pytest.fixture
def repo(store: Store) -> Repository:
    return Repository(store, clock=lambda: 1700000000.0)
