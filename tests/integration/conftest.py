"""A server shared by a module's tests that need only a running one (each ``ckptd
serve`` start costs ~1 CPU-second, and the suite's wall time on CI's two cores is
its CPU). Its tests share its store: each names its own jobs and assumes nothing
about what else the store holds; a test that restarts or stops its server, needs
other flags or settings, or looks at the whole store takes ``server`` (tests/conftest.py),
a fresh one of its own. Under pytest-xdist each worker that runs a module's tests
starts the module's server once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import ServerProcess


def _module_server(factory: pytest.TempPathFactory, name: str,
                   token: str | None = None) -> Iterator[ServerProcess]:
    srv = ServerProcess(store=factory.mktemp(name) / "store", token=token)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server on a local store for the module's tests, no token."""
    yield from _module_server(tmp_path_factory, "shared-server")


@pytest.fixture(scope="module")
def shared_token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server that requires a bearer token, for the module's tests."""
    yield from _module_server(tmp_path_factory, "shared-token-server", "s3cret-token")
