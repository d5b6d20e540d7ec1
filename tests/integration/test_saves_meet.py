"""Two saves of one step by one rank: a health-triggered coordinated snapshot that
lands on a step the loop also saves never fails the job. The same bytes saved
twice are one save; different bytes keep the first save and fail the second,
typed (``Conflict``), before anything of it is stored."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer, SaveHandle
from ckptd.client.health.policy_file import parse_policy
from ckptd.client.health.readings import ScriptedSource
from ckptd.errors import Conflict
from tests.conftest import ServerProcess

ECC = "gpu_ecc_uncorrected_volatile[0]"
FAST = parse_policy("[probe]\ninterval_s = 0.05\n\n[actions]\nsnapshot_min_interval_s = 0\n")


def _degraded_at_next_step(ckpt: Checkpointer, source: ScriptedSource) -> None:
    """The probe reads a degraded GPU now: the next ``step()`` takes a snapshot."""
    source.push({ECC: 2})
    ckpt._health_agent().probe.evaluate_now()


@pytest.fixture(params=["file", "http"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}"
        return
    server = ServerProcess(store=tmp_path / "store")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _open(url: str, shm: Path) -> tuple[Checkpointer, ScriptedSource]:
    source = ScriptedSource([{ECC: 0}])
    ckpt = Checkpointer(url, "meet", shm_dir=shm, health_policy=FAST, health_sources=[source],
                        serve_peers=False)
    return ckpt, source


def _until_snapshot(ckpt: Checkpointer, source: ScriptedSource, state: dict[str, Any], *,
                    save_first: bool) -> tuple[int, SaveHandle, SaveHandle | None]:
    """Runs the loop (saving each step before ``step()`` when ``save_first``) until
    ``step()`` takes the coordinated snapshot a degraded GPU asks for (the next step
    over a directory store; a few steps ahead, as the server names it, over HTTP):
    that step, the snapshot's handle, and the loop's own save of that step."""
    assert ckpt.step(1, loss=1.0, state=state) is None
    _degraded_at_next_step(ckpt, source)
    deadline = time.monotonic() + 30
    step = 1
    while time.monotonic() < deadline:  # bounded: a few heartbeats
        step += 1
        saved = ckpt.save(step, state) if save_first else None
        snapshot = ckpt.step(step, loss=1.0, state=state)
        if snapshot is not None:
            return step, snapshot, saved
        time.sleep(0.05)
    raise AssertionError("no coordinated snapshot within 30 s")


def test_a_snapshot_on_a_step_the_loop_saved_is_that_save(url: str, shm: Path) -> None:
    """The README's order: save(step), then step(step): the snapshot due at that step
    is the loop's save of it (before: a second manifest, AlreadyCommitted at close)."""
    state = {"w": torch.arange(4096.0)}
    ckpt, source = _open(url, shm)
    step, snapshot, saved = _until_snapshot(ckpt, source, state, save_first=True)
    assert snapshot is saved  # one save: the loop's
    assert snapshot.wait(60).state == "committed"
    closed = ckpt.close()
    assert (closed.saves, closed.failed) == (step - 1, 0)


def test_the_same_bytes_saved_again_are_one_save(url: str, shm: Path) -> None:
    """step(step) took the snapshot first, then the loop saves the same state under
    the same step: no second manifest, no failure; the snapshot's reason stays."""
    state = {"w": torch.arange(4096.0)}
    ckpt, source = _open(url, shm)
    step, snapshot, _ = _until_snapshot(ckpt, source, state, save_first=False)
    assert snapshot.wait(60).state == "committed"
    result = ckpt.save(step, state).wait(60)
    assert result.state == "committed" and result.bytes_sent == 0
    record = ckpt._call(ckpt.transport.read_commit("meet", step), 30)
    assert record.meta["reason"] == "health"
    closed = ckpt.close()
    assert (closed.saves, closed.failed) == (2, 0)


def test_other_bytes_under_a_saved_step_keep_the_first_and_say_so(url: str, shm: Path) -> None:
    state = {"w": torch.arange(4096.0), "b": torch.zeros(8)}
    ckpt, source = _open(url, shm)
    try:
        step, snapshot, _ = _until_snapshot(ckpt, source, state, save_first=False)
        assert snapshot.wait(60).state == "committed"
        state["w"] += 1  # the loop changed the state before its own save of the step
        with pytest.raises(Conflict) as raised:
            ckpt.save(step, state).wait(60)
        message = str(raised.value)
        assert f"step {step}" in message and "'w'" in message and "'b'" not in message
        assert "first save stands" in message and "another step" in message
        target = {"w": torch.zeros(4096), "b": torch.ones(8)}
        assert ckpt.restore(target).step == step
        assert torch.equal(target["w"], torch.arange(4096.0))  # the first save stands
    finally:
        ckpt.close(timeout=30)
