"""Two saves of one step by one rank: a health-triggered coordinated snapshot that
lands on a step the loop also saves never fails the job. The same bytes saved
twice are one save; different bytes keep the first save: when one of the two was
the coordinated snapshot, the second stores nothing and says so (a warning,
``SaveResult.kept_earlier``); two saves the loop made itself fail the second,
typed (``Conflict``), before anything of it is stored."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer, SaveHandle, calls
from ckptd.client.health.policy_file import parse_policy
from ckptd.client.health.readings import ScriptedSource
from ckptd.client.transport import LocalTransport, open_transport
from ckptd.client.transport_http import SyncTransport
from ckptd.errors import Conflict
from ckptd.lifecycle.tags import read_tags
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


def _tags(url: str) -> dict[str, int]:
    """The job's tags, read as ``ckptd tag`` would."""
    if url.startswith("file://"):
        async def read() -> dict[str, int]:
            transport = open_transport(url)
            assert isinstance(transport, LocalTransport)
            try:
                return dict(await read_tags(transport.repository.store, "meet"))
            finally:
                await transport.close()
        return asyncio.run(read())
    with SyncTransport(url, None, job="meet") as server:
        return dict(server.run(calls.tags("meet")))


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
    agent = ckpt._health_agent()
    if ckpt.heartbeat is not None:
        # Over HTTP the server names the step in its answer to the request the
        # probe's action sent from the agent's thread. These steps take 50 ms: on a
        # loaded machine the loop could pass the step named before the answer came
        # (skipped then, as it must be), which real steps leave time for.
        heard = time.monotonic() + 20
        while agent._posted_target is None and time.monotonic() < heard:
            time.sleep(0.01)
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
    assert snapshot is saved and saved is not None  # one save: the loop's
    assert saved.wait(60).state == "committed"
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


def test_a_snapshot_before_the_loops_own_save_of_other_bytes_never_fails_the_job(
        url: str, shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    """step(step) took the snapshot before the optimizer step, then the loop saves
    the step's new state: the snapshot stands, the save stores nothing and says so,
    and the loop goes on (before: ``Conflict`` out of the next step(), ending the job)."""
    state = {"w": torch.arange(4096.0), "b": torch.zeros(8)}
    ckpt, source = _open(url, shm)
    step, snapshot, _ = _until_snapshot(ckpt, source, state, save_first=False)
    state["w"] += 1  # the optimizer step the snapshot came before
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        handle = ckpt.save(step, state, tag="mine")
        ckpt.step(step + 1, loss=1.0, state=state)  # the loop goes on
        result = handle.wait(60)
    assert result.kept_earlier and result.bytes_sent == 0 and result.state == "committed"
    said = [r.getMessage() for r in caplog.records if "saved twice" in r.getMessage()]
    assert len(said) == 1 and "'w'" in said[0] and "'b'" not in said[0], said
    assert "first save stands" in said[0] and "save() before step()" in said[0]
    assert ckpt.save(step + 1, state).wait(60).state == "committed"
    ckpt.step(step + 2, loss=1.0, state=state)
    # The save's tag names the step that stands.
    assert ckpt._call(ckpt.transport.read_commit("meet", step), 30).meta["reason"] == "health"
    closed = ckpt.close()
    assert closed.failed == 0
    with Checkpointer(url, "meet", shm_dir=shm, serve_peers=False) as again:
        target = {"w": torch.zeros(4096), "b": torch.ones(8)}
        assert again.restore(target, step).step == step
        assert torch.equal(target["w"], torch.arange(4096.0))  # the first save stands
    assert _tags(url).get("mine") == step


def test_the_loops_own_two_saves_of_other_bytes_keep_the_first_and_say_so(
        url: str, shm: Path) -> None:
    """No snapshot involved: a second save() of a step with other bytes is the
    caller's mistake, ``Conflict`` (as the server says it), the first save stands."""
    state = {"w": torch.arange(4096.0), "b": torch.zeros(8)}
    ckpt, _ = _open(url, shm)
    try:
        assert ckpt.save(3, state).wait(60).state == "committed"
        state["w"] += 1
        with pytest.raises(Conflict) as raised:
            ckpt.save(3, state).wait(60)
        message = str(raised.value)
        assert "step 3" in message and "'w'" in message and "'b'" not in message
        assert "first save stands" in message and "another step" in message
        target = {"w": torch.zeros(4096), "b": torch.ones(8)}
        assert ckpt.restore(target).step == 3
        assert torch.equal(target["w"], torch.arange(4096.0))  # the first save stands
    finally:
        ckpt.close(timeout=30)


def test_a_save_that_says_it_is_the_health_snapshot_counts_as_one(url: str, shm: Path) -> None:
    """The HealthAgent used directly (docs/policy.md): ``save(step, state,
    meta=decision.meta)`` is the coordinated snapshot, so the loop's own save of other
    bytes after it keeps it and does not fail."""
    state = {"w": torch.arange(4096.0)}
    ckpt, _ = _open(url, shm)
    assert ckpt.save(5, state, meta={"reason": "health", "requested_by": 0}).wait(60)
    state["w"] += 1
    result = ckpt.save(5, state).wait(60)
    assert result.kept_earlier and result.state == "committed"
    assert ckpt.close().failed == 0
