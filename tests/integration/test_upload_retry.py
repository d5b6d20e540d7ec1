"""Uploads survive transient server errors: a real server on 127.0.0.1 whose store
fails chosen writes (driven and counted by the test), and the real client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import uvicorn

from ckptd.client import Checkpointer
from ckptd.errors import StoreError
from ckptd.server.app import create_app
from ckptd.server.settings import Settings
from ckptd.store import LocalStore
from ckptd.testing.faults import FaultyStore
from tests.conftest import free_port


class ThreadServer:
    """The server application on 127.0.0.1 in a thread of the test process, so the
    test holds the very store object the server writes through."""

    def __init__(self, store: FaultyStore) -> None:
        self.store = store
        self.port = free_port()
        config = uvicorn.Config(
            create_app(Settings(store="memory://", port=self.port), store=store),
            host="127.0.0.1", port=self.port, log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture
def faulty_server(tmp_path: Path) -> Iterator[ThreadServer]:
    with ThreadServer(FaultyStore(LocalStore(tmp_path / "store"))) as srv:
        yield srv


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(77, generator=g), "n": 3}


def test_an_upload_that_fails_twice_with_5xx_then_succeeds(
    faulty_server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "3")
    monkeypatch.setenv("CKPTD_RETRY_BACKOFF", "0.01")
    store = faulty_server.store
    # The first two writes of one chunk fail inside the server: two HTTP 500s for
    # the same upload. (Each armed fault fires on the next matching call after the
    # one before it fired.)
    one_chunk = {"w": torch.arange(1000.0), "n": 3}
    for _ in range(2):
        store.fail_at("put_if_absent", 1, StoreError, match="chunks/")
    with Checkpointer(faulty_server.url, job="retry", chunk_size=64 * 1024) as ckpt:
        ckpt.save(1, one_chunk).wait(timeout=60)
        assert store.failures["put_if_absent"] == 2
        assert store.count("put_if_absent", "chunks/") == 3  # one chunk, three tries
        result = ckpt.save(2, state()).wait(timeout=60)
        assert result.state == "committed"
        restored: dict[str, object] = {}
        ckpt.restore(restored)
    expected = state()
    assert torch.equal(restored["w"], expected["w"])  # type: ignore[arg-type]
    assert torch.equal(restored["b"], expected["b"])  # type: ignore[arg-type]
    assert restored["n"] == 3


def test_an_upload_that_keeps_failing_gives_a_typed_error_and_training_goes_on(
    faulty_server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_RETRIES", "2")
    monkeypatch.setenv("CKPTD_RETRY_BACKOFF", "0.01")
    store = faulty_server.store
    one_chunk = {"w": torch.arange(1000.0)}
    for _ in range(3):  # the first try and both retries of its one chunk
        store.fail_at("put_if_absent", 1, StoreError, match="chunks/")
    with Checkpointer(faulty_server.url, job="retry", chunk_size=64 * 1024) as ckpt:
        handle = ckpt.save(1, one_chunk)
        with pytest.raises(StoreError):
            handle.wait(timeout=60)
        assert store.failures["put_if_absent"] == 3
        assert ckpt.latest() is None  # nothing half-made became visible
        # The loop carries on, and the next snapshot goes through.
        assert ckpt.save(2, one_chunk).wait(timeout=60).state == "committed"
        assert ckpt.latest() == 2
