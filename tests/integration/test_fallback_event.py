"""A ``restore_fallback`` event says that a restore of "latest" fell back past damage
to an older step. Asking which step latest is (``GET /latest``, ``ckpt.latest()``,
``ckptd ls``, ``ckptd status``) restores nothing and records none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from tests.conftest import ServerProcess
from tests.integration.test_cli_mistakes import ckptd


def _fallbacks(api: httpx.Client, job: str) -> list[dict[str, Any]]:
    r = api.get(f"/v1/jobs/{job}/events")
    assert r.status_code == 200, r.text
    return [e for e in r.json()["events"] if e["kind"] == "restore_fallback"]


def test_asking_for_latest_records_no_fallback_a_restore_that_falls_back_does(
    server: ServerProcess, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(server.url, job="fb", shm_dir=str(shm), heartbeat_interval=0) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, {"w": torch.full((64,), float(step))}).wait(60).state == (
                "committed")
    manifest = Path(server.store) / "jobs" / "fb" / "steps" / "2" / "ranks" / "0.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # latest is damaged: step 1 is used
    with httpx.Client(base_url=server.url, timeout=60.0) as api:
        r = api.get("/v1/jobs/fb/latest")
        assert r.status_code == 200 and r.json()["step"] == 1 and r.json()["problems"], r.text
        with Checkpointer(server.url, job="fb", shm_dir=str(shm), heartbeat_interval=0) as ckpt:
            assert ckpt.latest() == 1
        for command in (["ls", "fb"], ["ls"], ["status", "fb"]):
            done = ckptd(*command, "--url", server.url)
            # (exit 1 where the command reports the damage it found)
            assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (
                done.stdout + done.stderr)
        assert "restore_fallback" not in done.stdout, done.stdout
        assert _fallbacks(api, "fb") == []

        with Checkpointer(server.url, job="fb", shm_dir=str(shm), heartbeat_interval=0) as ckpt:
            state = {"w": torch.zeros(64)}
            result = ckpt.restore(state)
        assert result.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
        (event,) = _fallbacks(api, "fb")  # one restore, one event
        assert event["step"] == 1 and event["rank"] == 0, event
        assert "steps/2/ranks/0.json" in event["reason"], event
        done = ckptd("status", "fb", "--url", server.url)
        assert "restore_fallback" in done.stdout, done.stdout + done.stderr

        # A restore from the store alone, reading through the server, asks for no plan
        # (it reads the manifest): it is one all the same.
        monkeypatch.setenv("CKPTD_DIRECT_READS", "0")
        with Checkpointer(server.url, job="fb", shm_dir=str(shm), heartbeat_interval=0) as ckpt:
            assert ckpt.restore({"w": torch.zeros(64)}, tiers=["store"]).step == 1
        assert len(_fallbacks(api, "fb")) == 2
        # A load of "latest" in one plan (DCP's reader) that falls back is one too.
        r = api.get("/v1/jobs/fb/step-plan", params={"rank": 1})
        assert r.status_code == 200 and r.json()["step"] == 1, r.text
        assert [e["rank"] for e in _fallbacks(api, "fb")] == [0, 0, 1]
