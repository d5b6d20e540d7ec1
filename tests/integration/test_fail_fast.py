"""Fail fast, speak once: a Checkpointer whose server cannot be reached, or refuses
its token, says so at construction within seconds, in one typed error naming the
URL and what to do, with no library exceptions chained under it; and a process
that made one exits without asyncio's complaints."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import httpx
import pytest
import torch

from ckptd import knobs
from ckptd.client import Checkpointer
from ckptd.errors import CkptdError, Unauthorized, Unavailable
from tests.conftest import ServerProcess, free_port
from tests.integration.test_replica_host_gone import silent_port

ROOT = Path(__file__).resolve().parents[2]


def _raised(make: object, bound: float) -> CkptdError:
    t0 = time.monotonic()
    with pytest.raises(CkptdError) as raised:
        make()  # type: ignore[operator]
    took = time.monotonic() - t0
    assert took < bound, f"it took {took:.1f} s to say so (bound {bound} s)"
    err = raised.value
    # One error: nothing of httpx or httpcore chained under it, a short traceback.
    assert err.__cause__ is None and err.__suppress_context__
    frames = traceback.extract_tb(err.__traceback__)
    assert len(frames) <= 4, traceback.format_tb(err.__traceback__)
    return err


def test_nothing_listening_is_said_at_construction(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Said in a warning after 2 s (what it waits for, what to do), raised once
    ``CKPTD_SERVER_WAIT`` (20 s by default: a server may be restarting) ran out."""
    # (6 s, not 3: a loaded machine's tries came far enough apart that the one past
    # 2 s was already past the deadline, and it raised without the warning)
    monkeypatch.setenv("CKPTD_SERVER_WAIT", "6")
    url = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        err = _raised(lambda: Checkpointer(url, "ff", shm_dir=shm), knobs.server_wait() + 2.0)
    said = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert len(said) == 1 and "connection refused" in said[0] and "ckptd serve" in said[0]
    assert isinstance(err, Unavailable)
    assert url in err.message and "connection refused" in err.message
    assert "ckptd serve" in err.message and "CKPTD_URL" in err.message
    # (a multi-node probe's CKPTD_URL=http://127.0.0.1:8470 on a node without the server)
    assert "127.0.0.1 is this host: on a node other than the server's" in err.message
    assert not list(shm.iterdir())  # nothing left behind: no pool, no threads serving


def test_a_refused_connection_to_another_host_names_the_servers_default_host() -> None:
    """(The same probe: a server started as in the quick start, --host 127.0.0.1, was
    "connection refused" to every other node, with no word of --host.)"""
    from ckptd.client.reach import _where_hint

    refused = httpx.ConnectError("refused")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    said = _where_hint("http://ckptd-a:8470", refused)
    assert "default --host 127.0.0.1" in said and "--host 0.0.0.0" in said, said
    assert _where_hint("http://ckptd-a:8470", httpx.ConnectError("no route")) == ""


def test_a_host_that_answers_nothing_is_said_within_a_connect_timeout(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 s, not the 3 s default: the bound is one connect timeout, whatever it is set to.
    monkeypatch.setenv("CKPTD_CONNECT_TIMEOUT", "1")
    port = free_port()
    with silent_port(port):
        err = _raised(lambda: Checkpointer(f"http://127.0.0.1:{port}", "ff", shm_dir=shm),
                      knobs.connect_timeout() + 3.0)
    assert isinstance(err, Unavailable)
    assert f"http://127.0.0.1:{port}" in err.message and "CKPTD_CONNECT_TIMEOUT" in err.message


def test_a_listed_replica_that_does_not_resolve_is_named(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by a deploy review.) A replica that advertises a name this host cannot
    resolve (a short Kubernetes name, seen from another namespace): the error named
    the URL given, which answered, and said to start a server there."""
    monkeypatch.setenv("CKPTD_SERVER_WAIT", "2")
    port = free_port()
    listed = f"http://ckptd-nowhere.invalid:{port}"
    srv = ServerProcess(store=tmp_path / "store", port=port,
                        extra_args=["--peers", listed, "--advertise-url", listed])
    srv.start()
    try:
        err = _raised(lambda: Checkpointer(srv.url, "ff", shm_dir=shm),
                      knobs.server_wait() + 10.0)
    finally:
        srv.stop()
    assert isinstance(err, Unavailable)
    assert f"cannot reach the ckptd replica {listed}" in err.message, err.message
    assert f"which {srv.url} lists as a member" in err.message
    assert "--advertise-url" in err.message and "ckptd serve)" not in err.message


def test_a_refused_token_is_said_at_construction(token_server: ServerProcess, shm: Path) -> None:
    wrong = _raised(lambda: Checkpointer(token_server.url, "ff", token="not-it", shm_dir=shm),
                    3.0)
    assert isinstance(wrong, Unauthorized)
    assert token_server.url in wrong.message and "refused the token given" in wrong.message
    assert "CKPTD_TOKEN" in wrong.message
    none = _raised(lambda: Checkpointer(token_server.url, "ff", shm_dir=shm), 3.0)
    assert isinstance(none, Unauthorized) and "none was given" in none.message
    with Checkpointer(token_server.url, "ff", token=token_server.token, shm_dir=shm,
                      serve_peers=False) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(4)}).wait(30).state == "committed"


def test_a_server_gone_later_is_one_typed_error(server: ServerProcess, shm: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_RETRY_BACKOFF", "0.01")
    with Checkpointer(server.url, "ff", shm_dir=shm, serve_peers=False) as ckpt:
        server.stop()
        with pytest.raises(Unavailable) as raised:
            ckpt.latest()
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
        assert server.url in str(raised.value)


def test_a_quick_checkpointer_leaves_no_asyncio_complaint_at_exit(tmp_path: Path) -> None:
    """Closing at once, before the timeline question came back, left the task
    pending when the loop stopped: 'Task was destroyed but it is pending!'."""
    script = (
        "from ckptd.client import Checkpointer\n"
        "for i in range(5):\n"
        f"    Checkpointer('file://{tmp_path / 'store'}', 'quick', shm_dir='{tmp_path}').close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "was destroyed" not in done.stderr and "never retrieved" not in done.stderr, (
        done.stderr)


def test_a_server_restarting_as_a_rank_starts_is_waited_for(
        server: ServerProcess, shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A replacement rank that starts while its server restarts (a `systemctl
    restart`, a container restarted: ckptd serve takes about 2 s to listen on this
    machine) gets its Checkpointer once the server is back, as the first call's
    retries gave it before construction asked the server; it is told within 2 s
    what it waits for. (It raised after 2 s, ending the rank: torchrun then
    restarts the whole group.)"""
    server.stop()
    back = threading.Timer(4.0, server.start)  # down 4 s, then ~2 s to listen
    back.start()
    try:
        with caplog.at_level(logging.WARNING, logger="ckptd.client"):
            t0 = time.time()
            with Checkpointer(server.url, "ff", shm_dir=shm, serve_peers=False) as ckpt:
                took = time.time() - t0
                assert ckpt.save(1, {"w": torch.ones(4)}).wait(30).state == "committed"
    finally:
        back.join()
    assert took > 4.0
    said = [r for r in caplog.records if server.url in r.getMessage()]
    assert said and "CKPTD_SERVER_WAIT" in said[0].getMessage(), said
    assert said[0].created - t0 < 3.5  # said while it waits, not only once it gave up
