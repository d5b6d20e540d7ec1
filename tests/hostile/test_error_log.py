"""An expected 5xx (``gc_in_progress``, ``store_corrupt``) is one WARNING line in
the server's log naming the code, the message and the path: no traceback, which
reads as a crash to whoever watches the log."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.lifecycle.documents import GcState
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(store=tmp_path / "store")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _logged(srv: ServerProcess, path: str, code: str) -> list[str]:
    """The server's log line of the answer to ``path`` naming ``code`` and the lines
    after it, once it is there (it is written after the answer)."""
    deadline = time.monotonic() + 10
    while True:
        lines = srv.log().splitlines()
        named = [i for i, line in enumerate(lines) if f" {path}: " in line and code in line]
        if named or time.monotonic() > deadline:
            # The named line and what follows it (a traceback would).
            return lines[named[0]:named[0] + 4] if named else []
        time.sleep(0.1)


def test_store_corrupt_is_one_warning_line(srv: ServerProcess) -> None:
    with Checkpointer(srv.url, "j", chunk_size=4096, serve_peers=False,
                      heartbeat_interval=0) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(8)}).wait(timeout=60).state == "committed"
    record = Path(srv.store) / "jobs" / "j" / "steps" / "1" / "commit.json"
    record.write_bytes(record.read_bytes()[:40])
    r = httpx.get(f"{srv.url}/v1/jobs/j/steps/1", timeout=30)
    assert r.status_code == 500 and r.json()["code"] == "store_corrupt", r.text
    lines = _logged(srv, "/v1/jobs/j/steps/1", "store_corrupt")
    assert lines, srv.log()
    assert " WARNING " in lines[0] and "/v1/jobs/j/steps/1" in lines[0], lines
    assert "jobs/j/steps/1/commit.json" in lines[0], lines
    assert not any("Traceback" in line for line in lines), srv.log()


def test_gc_in_progress_is_one_warning_line(srv: ServerProcess) -> None:
    now = time.time()
    state = GcState(generation=1, phase="marking", holder="someone-else",
                    started_at=now, expires_at=now + 3600)
    (Path(srv.store) / "gc").mkdir(parents=True, exist_ok=True)
    (Path(srv.store) / "gc" / "state").write_bytes(state.canonical())
    r = httpx.post(f"{srv.url}/v1/gc", timeout=30)
    assert r.status_code == 503 and r.json()["code"] == "gc_in_progress", r.text
    lines = _logged(srv, "/v1/gc", "gc_in_progress")
    assert lines, srv.log()
    assert " WARNING " in lines[0] and "/v1/gc" in lines[0], lines
    assert "already marking" in lines[0], lines
    assert not any("Traceback" in line for line in lines), srv.log()
