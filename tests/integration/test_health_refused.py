"""A rank whose write token is revoked while the job runs, against a real ``ckptd
serve`` with a tokens file: heartbeats back off while refused and come back when
the token is accepted again, a NaN's rollback request is not retried for minutes
after a refusal and says what to do, and a failed save names a token of the job's
scope as the fix (not "the server's token")."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.client.health import heartbeat as heartbeat_module
from ckptd.client.health.agent import HealthAgent
from ckptd.client.health.heartbeat import Heartbeat
from ckptd.client.health.readings import LoopSource, RttSource
from ckptd.errors import RollbackRequested, Unauthorized
from ckptd.tokens import create_token, revoke_token
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(60)

ROOT_TOKEN = "root-token-for-refusals"
INTERVAL = 0.2


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    tokens = tmp_path / "tokens.json"
    srv = ServerProcess(store=tmp_path / "store", token=ROOT_TOKEN,
                        extra_args=["--heartbeat-interval", str(INTERVAL),
                                    "--tokens-file", str(tokens)])
    create_token(tokens, "other", "read")  # the file exists before the server starts
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def wait_until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def answers(srv: ServerProcess, token: str, job: str) -> int:
    return httpx.get(f"{srv.url}/v1/jobs/{job}/steps",
                     headers={"Authorization": f"Bearer {token}"}).status_code


def grant(srv: ServerProcess, tokens: Path, job: str) -> tuple[str, str]:
    """A write token of ``job``, once the server accepts it; and its id."""
    token, entry = create_token(tokens, job, "write")
    wait_until(lambda: answers(srv, token, job) == 200)
    return token, entry.id


def revoke(srv: ServerProcess, tokens: Path, token: str, token_id: str, job: str) -> None:
    assert revoke_token(tokens, token_id)
    wait_until(lambda: answers(srv, token, job) == 401)


def state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), v)}


def test_heartbeats_back_off_while_the_token_is_refused_and_resume_when_accepted(
    server: tuple[ServerProcess, Path], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    srv, tokens = server
    monkeypatch.setattr(heartbeat_module, "REFUSED_INTERVAL_S", 1.5, raising=False)
    job = "hb-refused"
    token, token_id = grant(srv, tokens, job)
    kept = tokens.read_bytes()
    hb = Heartbeat(srv.url, job, 0, 1, token, interval=INTERVAL).start()
    try:
        wait_until(lambda: hb.beats >= 2)
        with caplog.at_level(logging.WARNING, logger="ckptd.client.health.heartbeat"):
            revoke(srv, tokens, token, token_id, job)
            wait_until(lambda: hb.failures >= 1)
            time.sleep(1.0)  # five intervals: one refused beat, not five
            assert hb.failures == 1 and hb.refused
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "[unauthorized]" in warnings[0], warnings
        assert "sent again every 1.5 s until the token is accepted" in warnings[0]
        # Granted again (the operator put the entry back): beats at the interval again.
        tokens.write_bytes(kept)
        wait_until(lambda: answers(srv, token, job) == 200)
        wait_until(lambda: not hb.refused, timeout=5)
        beats = hb.beats
        time.sleep(1.0)
        assert hb.beats >= beats + 3, hb
    finally:
        hb.stop()


def test_a_nan_after_the_token_is_refused_is_not_retried_and_says_what_to_do(
    server: tuple[ServerProcess, Path], caplog: pytest.LogCaptureFixture,
) -> None:
    srv, tokens = server
    job = "nan-refused"
    token, token_id = grant(srv, tokens, job)
    agent = HealthAgent(srv.url, job, 0, 1, token, sources=[LoopSource(), RttSource()],
                        heartbeat_interval=INTERVAL, timeout=2.0).start()
    try:
        agent.step(1, 1.0)
        revoke(srv, tokens, token, token_id, job)
        with caplog.at_level(logging.ERROR, logger="ckptd.client.health"):
            started = time.monotonic()
            with pytest.raises(RollbackRequested) as raised:
                agent.step(2, math.nan)
            assert time.monotonic() - started < 2.0
        assert raised.value.rollback_unknown
        text = caplog.text
        assert "refused this rank's token" in text, text
        assert f"ckptd token create --job {job} --role write" in text
        assert "once the server answers" not in text
        assert agent._marker_retry is None  # no retries for minutes: it answered
    finally:
        agent.close()


def test_a_save_refused_after_the_token_is_revoked_names_a_token_of_the_job(
    server: tuple[ServerProcess, Path], shm: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    srv, tokens = server
    job = "save-refused"
    token, token_id = grant(srv, tokens, job)
    c = Checkpointer(srv.url, job, token=token, shm_dir=shm, timeout=5.0, on_error="warn")
    try:
        c.save(1, state(1)).wait(30)
        revoke(srv, tokens, token, token_id, job)
        with (caplog.at_level(logging.ERROR, logger="ckptd.client.checkpointer"),
              pytest.raises(Unauthorized)):
            c.save(2, state(2)).wait(30)
        text = caplog.text
        assert "what to do:" in text, text
        assert f"whose scope covers job '{job}' with write access" in text
        assert f"ckptd token create --job {job} --role write" in text
        assert "pass the server's token" not in text
    finally:
        c.close(timeout=5)
