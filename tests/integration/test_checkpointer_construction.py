"""What a new ``Checkpointer`` learns and says at construction, as a fresh user's
probe met it: a token that may only read its job (an eval job's restores; its
saves were refused in the background, a refused heartbeat every interval); the
advice a failed save logs under each ``on_error`` (it said "training goes on"
where the next ``step()`` raised); and a server URL with a path or without its
scheme (said worse than the CLI and the Lightning plugin say it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import Forbidden, InvalidRequest, Unavailable
from ckptd.tokens import create_token
from tests.conftest import ServerProcess
from tests.relay import relay

ADMIN = "ADMIN-token"
JOB = "llm-b"
READ_ONLY = "but not write it"  # the construction's warning about a read token


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[ServerProcess, dict[str, str]]]:
    """``ckptd serve --token ADMIN --tokens-file F``, with a read and a write token
    on ``llm-*`` (``ckptd token create --job 'llm-*' --role read --file F``)."""
    tmp = tmp_path_factory.mktemp("tenants")
    tokens_file = tmp / "tokens.json"
    tokens = {role: create_token(tokens_file, "llm-*", role)[0] for role in ("read", "write")}
    tokens["admin"] = ADMIN
    srv = ServerProcess(store=tmp / "store", token=ADMIN,
                        extra_args=["--tokens-file", str(tokens_file)])
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def _said(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if all(w in r.getMessage() for w in words)]


def test_a_read_token_restores_and_its_saves_are_refused_at_once(
        tenants: tuple[ServerProcess, dict[str, str]], shm: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: construction passed in silence, every heartbeat logged ``[forbidden]``,
    and each save failed in the background with advice that training goes on, then
    ``step()`` and ``close()`` raised it with a traceback."""
    srv, tokens = tenants
    (shm / "w").mkdir()
    (shm / "r").mkdir()
    weights = torch.arange(64, dtype=torch.float32)
    with Checkpointer(srv.url, JOB, token=tokens["write"], shm_dir=shm / "w",
                      serve_peers=False) as writer:
        assert writer.save(1, {"w": weights}).wait(30).state == "committed"

    caplog.set_level(logging.INFO, logger="ckptd")
    reader = Checkpointer(srv.url, JOB, token=tokens["read"], shm_dir=shm / "r",
                          heartbeat_interval=0.1)
    try:
        said = _said(caplog, READ_ONLY)
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert "can restore" in said[0] and "saves will be refused" in said[0], said
        assert "role write" in said[0] and "\n" not in said[0], said

        state = {"w": torch.zeros(64)}
        assert reader.restore(state).step == 1
        assert torch.equal(state["w"], weights)  # restore works as with any token

        t0 = time.monotonic()
        with pytest.raises(Forbidden) as refused:
            reader.save(2, state)
        assert time.monotonic() - t0 < 2.0  # refused here, not after an upload
        message = refused.value.message
        assert "\n" not in message and "role write" in message and JOB in message, message
        assert refused.value.__cause__ is None

        time.sleep(0.6)  # six heartbeat intervals: each would have been a refused beat
        hb = reader.heartbeat
        assert hb is None or (hb.beats, hb.failures) == (0, 0), hb
        assert not _said(caplog, "heartbeat", "forbidden")
        assert reader.step(3) is None  # the loop's step() has nothing to raise
    finally:
        result = reader.close()  # nothing failed in the background: nothing raised
    assert (result.saves, result.failed) == (0, 0), result
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_read_tokens_health_probe_asks_nothing_of_the_server(
        tenants: tuple[ServerProcess, dict[str, str]], shm: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """(Found by review.) An eval job's loop with a token that may only read: a
    degraded reading did ask the server for a coordinated snapshot, and a NaN loss
    tried to mark the job for rollback, each refused (forbidden) and the marker
    retried. Now the probe runs, a NaN loss still sends this loop back to the latest
    commit, and the server is asked nothing: the writers' job stays as it is."""
    import httpx

    from ckptd.client.health.readings import ScriptedSource
    from ckptd.errors import RollbackRequested

    srv, tokens = tenants
    job = "llm-eval"
    (shm / "w").mkdir()
    (shm / "r").mkdir()
    with Checkpointer(srv.url, job, token=tokens["write"], shm_dir=shm / "w",
                      serve_peers=False) as writer:
        assert writer.save(1, {"w": torch.ones(8)}).wait(30).state == "committed"
    ecc = "gpu_ecc_uncorrected_volatile[0]"
    source = ScriptedSource([{ecc: 0}], name="gpu-eval")
    policy = tmp_path / "policy.toml"
    policy.write_text("[probe]\ninterval_s = 0.05\n[actions]\nsnapshot_min_interval_s = 0\n"
                      "[signals.step_time_ratio]\ndegraded = \"off\"\n")
    caplog.set_level(logging.INFO, logger="ckptd")
    asked: list[str] = []  # what the reader asked the server, through a relay

    def note(method: str, path: str) -> float:
        asked.append(f"{method} {path}")
        return 0.0

    with relay(srv.url, delay=note) as url:
        reader = Checkpointer(url, job, token=tokens["read"], shm_dir=shm / "r",
                              health_sources=[source], health_policy=str(policy))
        try:
            assert reader.step(2, loss=1.0) is None
            source.push({ecc: 2})  # degraded: the policy asks for a snapshot
            deadline = time.monotonic() + 10
            while (not _said(caplog, "may only read", "snapshot")
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            assert len(_said(caplog, "may only read", "snapshot")) == 1
            with pytest.raises(RollbackRequested) as back:
                reader.step(3, loss=float("nan"))
            assert back.value.rollback_to == 1
        finally:
            reader.close()  # (a marker's retry would be cancelled here: none is set)
    posted = [a for a in asked if a.startswith("POST") and ("rollback" in a or "snapshot" in a)]
    assert not posted, asked
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "forbidden" in m or "request failed" in m], said
    headers = {"Authorization": f"Bearer {tokens['admin']}"}
    base = f"{srv.url}/v1/jobs/{job}"
    assert httpx.get(f"{base}/rollback", headers=headers).json()["rollback_to"] is None
    kinds = [e["kind"] for e in httpx.get(f"{base}/events", headers=headers).json()["events"]]
    assert not [k for k in kinds if k.startswith(("rollback", "snapshot"))], kinds


@pytest.mark.parametrize("role", ["write", "admin"])
def test_a_token_that_may_write_is_not_taken_for_a_read_one(
        role: str, tenants: tuple[ServerProcess, dict[str, str]], shm: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    srv, tokens = tenants
    caplog.set_level(logging.WARNING, logger="ckptd")
    with Checkpointer(srv.url, f"llm-{role}", token=tokens[role], shm_dir=shm,
                      serve_peers=False) as ckpt:
        assert not _said(caplog, READ_ONLY)
        assert ckpt.save(1, {"w": torch.ones(8)}).wait(30).state == "committed"


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_failed_saves_advice_says_what_the_mode_in_force_does(
        on_error: str, server: ServerProcess, shm: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The probe's kill -9 of the server under the README's loop: with the default
    ``on_error="raise"`` the log said "training goes on, and saves fail until it
    answers", and the next ``step()`` raised, ending the job."""
    monkeypatch.setenv("CKPTD_RETRIES", "0")
    caplog.set_level(logging.ERROR, logger="ckptd")
    ckpt = Checkpointer(server.url, "adv", shm_dir=shm, on_error=on_error,  # type: ignore[arg-type]
                        serve_peers=False, timeout=60)
    try:
        assert ckpt.save(1, {"w": torch.ones(8)}).wait(30).state == "committed"
        server.stop()
        ckpt.save(2, {"w": torch.full((8,), 2.0)})
        deadline = time.monotonic() + 60
        while not _said(caplog, "what to do") and time.monotonic() < deadline:
            time.sleep(0.05)
        said = _said(caplog, "what to do")
        assert len(said) == 1, said
        advice = said[0].split("what to do:")[1]
        assert "server is up and reachable" in advice, advice
        if on_error == "raise":
            assert "training goes on" not in advice, advice
            assert "the next save(), step() or close() raises" in advice, advice
            with pytest.raises(Unavailable):  # as the advice says
                ckpt.step(3)
        else:
            assert "training goes on" in advice, advice
            with pytest.warns(UserWarning):  # SnapshotFailureWarning: and goes on
                assert ckpt.step(3) is None
    finally:
        ckpt._close(timeout=5)


@pytest.mark.parametrize(("url", "says"), [
    ("localhost:8470", "url 'localhost:8470' has no scheme: did you mean http://localhost:8470?"),
    ("127.0.0.1:18471", "did you mean http://127.0.0.1:18471?"),
    ("relative/store", "is a path, not a URL: a directory store is file:///"),
])
def test_a_url_without_its_scheme_is_said_as_the_cli_says_it(
        url: str, says: str, shm: Path) -> None:
    """Before: "unsupported URL 'localhost:8470': use http://host:port, ..."."""
    with pytest.raises(InvalidRequest) as refused:
        Checkpointer(url, "u", shm_dir=shm)
    assert says in refused.value.message and "\n" not in refused.value.message


def test_a_server_url_with_the_api_path_is_said_at_construction(
        tenants: tuple[ServerProcess, dict[str, str]], shm: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``NotFound no route for GET /v1/v1/jobs/u/rollback`` from the server."""
    srv, tokens = tenants
    for bad in (f"{srv.url}/v1", f"{srv.url}/v1/jobs?x=1", f"{srv.url},{srv.url}/v1"):
        with pytest.raises(InvalidRequest) as refused:
            Checkpointer(bad, "u", token=ADMIN, shm_dir=shm)
        message = refused.value.message
        assert "has a path or query" in message, message
        assert f"url={srv.url})" in message and "\n" not in message, message
    # From the environment, the variable is named.
    monkeypatch.setenv("CKPTD_URL", "localhost:8470")
    with pytest.raises(InvalidRequest, match="CKPTD_URL 'localhost:8470' has no scheme: "
                                             r"did you mean http://localhost:8470\?"):
        Checkpointer(job="u", shm_dir=shm)
    # The Lightning plugin and the Checkpointer say it in the same words.
    from ckptd.client.integrations.lightning.arguments import check_url

    for bad in (f"{srv.url}/v1", "localhost:8470"):
        with pytest.raises(InvalidRequest) as plugin:
            check_url(bad)
        with pytest.raises(InvalidRequest) as client:
            Checkpointer(bad, "u", token=ADMIN, shm_dir=shm)
        assert plugin.value.message.split(" (")[0] == client.value.message.split(" (")[0]


def test_a_proxys_403_to_a_write_is_not_taken_for_a_read_only_token() -> None:
    """(Found by review.) Only ckptd's own refusal of a write (``forbidden``, needs
    write) makes a read-only checkpointer: a WAF or an ingress that answers a POST
    with its own HTML 403 is no answer about the token."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ckptd.client.reach import may_write
    from ckptd.client.transport import HttpTransport

    class Proxy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = b"<html><body>403 Forbidden (request blocked)</body></html>"
            self.send_response(403)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Proxy) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()

        async def ask() -> str | None:
            transport = HttpTransport(f"http://127.0.0.1:{proxy.server_address[1]}", job="j")
            try:
                return await may_write(transport)
            finally:
                await transport.close()

        try:
            assert asyncio.run(ask()) is None
        finally:
            proxy.shutdown()


def test_a_read_token_under_on_error_warn_skips_saves_and_training_goes_on(
        tenants: tuple[ServerProcess, dict[str, str]], shm: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """(Found by review.) ``on_error="warn"`` promises training goes on: a read-only
    checkpointer's saves, and the snapshots its health probe asks for in ``step()``,
    are skipped and said once, never raised."""
    from ckptd.errors import SnapshotSkipped

    srv, tokens = tenants
    caplog.set_level(logging.INFO, logger="ckptd")
    with Checkpointer(srv.url, JOB, token=tokens["read"], shm_dir=shm, on_error="warn",
                      serve_peers=False) as reader:
        for step in (5, 6):
            handle = reader.save(step, {"w": torch.zeros(8)})
            assert handle.skipped
            with pytest.raises(SnapshotSkipped):
                handle.wait(5)
        # (the probe's snapshot: coordinated, whatever on_error is)
        assert reader._saver.save(7, {"w": torch.zeros(8)}, coordinated=True).skipped
    said = _said(caplog, "skipped", "may only read")
    assert len(said) == 1, said


def test_a_cache_dir_written_as_a_file_url_is_read(server: ServerProcess, tmp_path: Path,
                                                   shm: Path) -> None:
    """(Found by a probe: ``cache_dir="file:///dir"`` was taken as a relative path that
    is not there, and the cache tier gave nothing, unsaid.) Another URL is refused at
    construction: the cache is a local directory."""
    from ckptd.client.restore import restore_command

    weights = torch.arange(4096, dtype=torch.float32)
    with Checkpointer(server.url, "cached", shm_dir=shm, serve_peers=False) as ckpt:
        assert ckpt.save(1, {"w": weights}).wait(30).state == "committed"
    cache = tmp_path / "cache"
    restore_command(server.url, "cached", 0, cache, progress=False)
    (tmp_path / "fresh").mkdir()  # (no pool of this rank: the cache is the first tier)
    into = {"w": torch.zeros(4096)}
    with Checkpointer(server.url, "cached", shm_dir=tmp_path / "fresh", serve_peers=False,
                      cache_dir=f"file://{cache}") as ckpt:
        result = ckpt.restore(into)
    assert result.bytes_from["cache"] == weights.nbytes, result.bytes_from
    assert torch.equal(into["w"], weights)
    with pytest.raises(InvalidRequest, match="not a local directory"):
        Checkpointer(server.url, "cached", shm_dir=shm, cache_dir=server.url)
