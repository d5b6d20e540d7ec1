"""A failed background save is never silent: named, logged once at ERROR with what
to do, raised (or warned of) at the next save(), step() or close(), counted by
close(), and reported in heartbeats, ``ckptd status`` and ``/metrics``."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.client import Checkpointer, LocalTransport, SnapshotFailureWarning
from ckptd.errors import ReplicaMismatch, StoreError, Superseded, Unavailable
from ckptd.repository import Repository
from ckptd.store import LocalStore
from ckptd.testing.faults import FaultyStore

pytestmark = pytest.mark.timeout(120)


def _pair(url: str, shm: Path, **kw: object) -> tuple[Checkpointer, Checkpointer]:
    a = Checkpointer(url, job="j", rank=0, world_size=2, shm_dir=shm, **kw)  # type: ignore[arg-type]
    b = Checkpointer(url, job="j", rank=1, world_size=2, shm_dir=shm, **kw)  # type: ignore[arg-type]
    return a, b


def _state(rank: int) -> dict[str, object]:
    # "seen" differs between ranks but is not named in local=: replicas disagree.
    return {"w": torch.ones(8), "seen": torch.full((4,), float(rank))}


def test_replica_mismatch_is_logged_once_and_raised_on_every_rank(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="ckptd")
    a, b = _pair(f"file://{tmp_path / 'store'}", shm)
    h0 = a.save(0, _state(0))
    h0.wait(30)  # pending: rank 1 is not in yet
    h1 = b.save(0, _state(1))
    with pytest.raises(ReplicaMismatch):
        h1.wait(30)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    text = errors[0].getMessage()
    assert "save of j step 0 rank 1 failed" in text and "'seen'" in text
    assert "local=['seen']" in text
    # The loop saw it through wait(): the next save does not raise it again.
    b.save(1, {"w": torch.ones(8), "seen": torch.zeros(4)}).wait(30)
    # Rank 0 never waited on a failing handle: it learns from the store that
    # step 0 can never commit, and close() raises it (after closing).
    with pytest.raises(ReplicaMismatch) as info:
        a.close()
    assert "save of j step 0 rank 0 failed" in str(info.value)
    assert a.latest is not None  # closed: no further use
    result = b.close()
    assert result.failed == 1 and result.saves == 2


def test_next_save_and_step_raise_a_failure_the_loop_never_waited_for(
    tmp_path: Path, shm: Path
) -> None:
    a, b = _pair(f"file://{tmp_path / 'store'}", shm)
    a.save(0, _state(0)).wait(30)
    b.save(0, _state(1))  # fails in the background; nobody waits
    deadline = time.monotonic() + 30
    with pytest.raises(ReplicaMismatch):
        while time.monotonic() < deadline:
            b.step(1, loss=1.0)
            time.sleep(0.05)
    with pytest.raises(ReplicaMismatch):  # rank 0: at a save, once it asked the store
        while time.monotonic() < deadline:
            a.save(2, {"w": torch.ones(8)}).wait(30)
            time.sleep(0.1)
    assert b.close().failed == 1
    assert a.close().failed == 1


def test_on_error_warn_warns_and_goes_on(tmp_path: Path, shm: Path) -> None:
    a, b = _pair(f"file://{tmp_path / 'store'}", shm, on_error="warn")
    a.save(0, _state(0)).wait(30)
    b.save(0, _state(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not caught:
            b.step(1, loss=1.0)
            time.sleep(0.05)
        result = b.close()
    assert [w.category for w in caught] == [SnapshotFailureWarning]
    assert "replicas on ranks" in str(caught[0].message)
    assert result.failed == 1 and isinstance(result.last_error, ReplicaMismatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert a.close().failed == 1
    assert [w.category for w in caught] == [SnapshotFailureWarning]


def test_failures_show_in_heartbeat_status_and_metrics(server: object, shm: Path) -> None:
    url = server.url  # type: ignore[attr-defined]
    a, b = _pair(url, shm, heartbeat_interval=0.2)
    a.save(0, _state(0)).wait(30)
    with pytest.raises(ReplicaMismatch):
        b.save(0, _state(1)).wait(30)
    deadline = time.monotonic() + 20
    ranks: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        ranks = httpx.get(f"{url}/v1/jobs/j/ranks").json()["ranks"]
        r1 = [r for r in ranks if r["rank"] == 1]
        if r1 and r1[0]["health"]["signals"].get("snapshot_failures") == 1:  # type: ignore[index]
            break
        time.sleep(0.1)
    r1 = [r for r in ranks if r["rank"] == 1][0]
    assert any("save of j step 0 rank 1 failed" in x
               for x in r1["health"]["reasons"])  # type: ignore[index]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'ckptd_snapshot_failures_total{job="j"} 1.0' in metrics
    b.close()
    with pytest.raises(ReplicaMismatch):  # rank 0 learns at close() that step 0 never commits
        a.close()


def test_a_save_to_a_stopped_server_names_the_save_then_the_cause(
    server: object, shm: Path
) -> None:
    ckpt = Checkpointer(server.url, job="j", shm_dir=shm, timeout=60)  # type: ignore[attr-defined]
    ckpt.save(0, {"w": torch.ones(4)}).wait(30)
    server.stop()  # type: ignore[attr-defined]
    with pytest.raises(Unavailable) as info:
        ckpt.save(1, {"w": torch.ones(4)}).wait(60)
    assert str(info.value).startswith("save of j step 1 rank 0 failed: ")
    assert ckpt.close().failed == 1


def test_url_and_token_come_from_the_environment(
    token_server: object, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_URL", token_server.url)  # type: ignore[attr-defined]
    monkeypatch.setenv("CKPTD_TOKEN", token_server.token)  # type: ignore[attr-defined]
    with Checkpointer(job="env", shm_dir=shm) as ckpt:
        assert ckpt.save(0, {"w": torch.ones(4)}).wait(30).state == "committed"
        assert ckpt.latest() == 0


def test_a_step_number_that_fails_again_after_a_rollback_is_not_silent(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Failures are told once per snapshot, not once per step number: a rollback
    replays step numbers, and a step that failed before may fail again."""
    caplog.set_level(logging.WARNING, logger="ckptd")
    store = FaultyStore(LocalStore(tmp_path / "store"))
    ckpt = Checkpointer(f"file://{tmp_path / 'store'}", job="j", shm_dir=shm)
    repo = Repository(store)
    ckpt._transport = LocalTransport(repo)
    w = {"w": torch.arange(64.0)}
    try:
        for step in (1, 2):
            assert ckpt.save(step, w).wait(30).state == "committed"
        ckpt._call(repo.set_rollback("j", 1), 30)  # an operator rolls the job back
        with pytest.raises(Superseded):  # the loop has not heard of the rollback yet
            ckpt.save(3, w).wait(30)
        ckpt.restore({"w": torch.zeros(64)}, step=1)
        # The replayed step 3 fails again, for another reason: its manifest write.
        store.fail_at("put_if_absent", match="/steps/3/ranks/")
        caplog.clear()
        ckpt.save(3, w)
        with pytest.raises(StoreError) as info:  # the next save waits for it, raises it
            ckpt.save(4, w)
        assert "save of j step 3 rank 0 failed" in str(info.value)
        assert store.failures["put_if_absent"] == 1
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "step 3" in errors[0].getMessage()
    finally:
        result = ckpt.close()
    assert result.failed == 2 and isinstance(result.last_error, StoreError)


class _SlowErrorLog(logging.Handler):
    """Holds up a background thread that logs an ERROR (a snapshot's done-callback
    logging its failure), as a slow log sink would."""

    def __init__(self, seconds: float) -> None:
        super().__init__(logging.ERROR)
        self.seconds = seconds
        self.held = 0

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.held += 1
            time.sleep(self.seconds)


def test_close_reports_the_last_snapshots_failure_whose_callback_runs_late(
    server: object, shm: Path
) -> None:
    """close() waits for the last snapshot's done-callback, not only its future (which
    is done before its callbacks run): the failure is in close()'s result and in
    the last heartbeat the server got."""
    url = server.url  # type: ignore[attr-defined]
    a, b = _pair(url, shm, on_error="warn")
    a.save(0, _state(0)).wait(30)
    slow = _SlowErrorLog(2.0)
    logger = logging.getLogger("ckptd.client.checkpointer")
    logger.addHandler(slow)
    try:
        b.save(0, _state(1))  # replicas disagree: fails once its manifest is in
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = b.close()  # at once: the snapshot is still in flight
    finally:
        logger.removeHandler(slow)
    assert slow.held == 1  # the failure was recorded by the done-callback, held up
    assert result.failed == 1 and isinstance(result.last_error, ReplicaMismatch)
    assert [w.category for w in caught] == [SnapshotFailureWarning]
    r1 = [r for r in httpx.get(f"{url}/v1/jobs/j/ranks").json()["ranks"] if r["rank"] == 1][0]
    assert r1["health"]["signals"].get("snapshot_failures") == 1, r1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.close()



def test_a_rank_always_first_to_commit_never_fails_a_step_that_committed(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 always commits first, so each of its saves ends pending and is asked
    about later. Asked oldest first, those questions fell behind a fast loop until
    they named a step retention was removing since it committed, which the server
    answers as not committed: rank 0 then raised NotCommitted for a step that had
    committed (the soak's probe, keep_last 4 at four steps a second). The newest
    pending step is asked first, and its commit settles the older ones."""
    import ckptd.repository.after_commit as after_commit
    from ckptd.keys import manifest_key, removal_key

    monkeypatch.setattr(after_commit, "REMOVAL_WAIT", 0.5)
    root = tmp_path / "store"
    a, b = _pair(f"file://{root}", shm, on_error="raise")
    for step in range(1, 11):
        assert a.save(step, {"w": torch.full((8,), float(step))}).wait(30).state == "pending"
    for step in range(1, 11):
        assert b.save(step, {"w": torch.full((8,), float(step))}).wait(30).state == "committed"
    # Retention is removing step 3 (keep_last): its claim is held, a manifest gone.
    claim = b'{"format":"ckptd.removal","since":%.3f,"token":"t","version":1}' % time.time()
    (root / removal_key("j", 3)).parent.mkdir(parents=True, exist_ok=True)
    (root / removal_key("j", 3)).write_bytes(claim)
    (root / manifest_key("j", 3, 0)).unlink()
    assert a.close().failed == 0
    assert b.close().failed == 0
