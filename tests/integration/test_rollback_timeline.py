"""A rollback ends the job's timeline: snapshots taken before it never mix into a
step saved after it (docs/FORMAT.md, "Timelines"), through a real ``ckptd serve``
and through ``file://``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import AlreadyCommitted, Superseded
from ckptd.format import RankManifest, manifest_key
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(90)

WORLD = 2


def state(value: float, step: int) -> dict[str, Any]:
    return {"w": torch.full((2048,), value), "step": step}


@pytest.fixture(params=["http", "file"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if request.param == "file":
        store = tmp_path / "store"
        yield f"file://{store}", store
        return
    srv = ServerProcess(store=tmp_path / "store")
    srv.start()
    try:
        yield srv.url, srv.store
    finally:
        srv.stop()


def rollback(url: str, store: Path, job: str, step: int) -> int:
    """Sets the rollback marker the way an operator or a NaN rank does; the epoch."""
    if url.startswith("http"):
        reply = httpx.post(f"{url}/v1/jobs/{job}/rollback", json={"step": step}, timeout=30)
        assert reply.status_code == 200, reply.text
        epoch: int = reply.json()["epoch"]
        return epoch
    import asyncio

    from ckptd.repository import Repository
    from ckptd.store import LocalStore

    async def run() -> int:
        repo = Repository(LocalStore(store))
        try:
            return (await repo.set_rollback(job, step)).epoch
        finally:
            await repo.close()

    return asyncio.run(run())


def test_saves_from_before_a_rollback_never_mix_into_a_step_saved_after_it(
    where: tuple[str, Path], tmp_path: Path
) -> None:
    url, store = where
    job = "timeline"
    ckpts = [Checkpointer(url, job, rank=r, world_size=WORLD, chunk_size=4096,
                          shm_dir=tmp_path / "shm", timeout=30.0, serve_peers=False)
             for r in range(WORLD)]
    try:
        handles = [c.save(1, state(1.0, 1)) for c in ckpts]
        assert "committed" in {h.wait(30).state for h in handles}
        # Rank 0 snapshots step 2 of the timeline that is about to end...
        assert ckpts[0].save(2, state(2.0, 2)).wait(30).state == "pending"
        assert rollback(url, store, job, 1) == 1  # ...rank 1's loss turns NaN
        # Rank 1 has not heard of the rollback yet: its snapshot is refused.
        with pytest.raises(Superseded) as info:
            ckpts[1].save(2, state(2.0, 2)).wait(30)
        assert info.value.code == "superseded"
        # Both roll back, then take the other path to step 2.
        for c in ckpts:
            back: dict[str, Any] = state(0.0, 0)
            c.restore(back, step=1)
            assert torch.equal(back["w"], state(1.0, 1)["w"]) and back["step"] == 1
        assert ckpts[1].save(2, state(-2.0, 2)).wait(30).state == "pending"
        assert ckpts[0].save(2, state(-2.0, 2)).wait(30).state == "committed"
        for c in ckpts:
            got: dict[str, Any] = state(0.0, 0)
            c.restore(got, step=2)
            assert torch.equal(got["w"], state(-2.0, 2)["w"])  # not the 2.0 of before
        for rank in range(WORLD):
            kept = RankManifest.parse((store / manifest_key(job, 2, rank)).read_bytes())
            assert kept.meta["epoch"] == 1
        # A checkpointer that starts now joins the current timeline by itself.
        with Checkpointer(url, job, rank=0, world_size=1, chunk_size=4096,
                          shm_dir=tmp_path / "shm2", serve_peers=False) as late:
            assert late.save(5, state(5.0, 5)).wait(30).state == "committed"
    finally:
        for c in ckpts:
            c.close(timeout=10.0)


def test_the_epoch_key_of_meta_is_reserved(tmp_path: Path) -> None:
    with (
        Checkpointer(f"file://{tmp_path / 'store'}", "meta", shm_dir=tmp_path / "shm") as c,
        pytest.raises(Exception, match="epoch"),
    ):
        c.save(1, state(1.0, 1), meta={"epoch": 3})


def test_a_rank_that_restores_a_step_off_the_timeline_stays_fenced(
    where: tuple[str, Path], tmp_path: Path
) -> None:
    """Steps 1 and 2 committed, then a rollback to 1. Restoring step 2 (the ended
    path) does not let a rank's saves in; restoring step 1 does."""
    url, store = where
    with Checkpointer(url, "offpath", chunk_size=4096, shm_dir=tmp_path / "shm",
                      serve_peers=False, timeout=30.0) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, state(float(step), step)).wait(30).state == "committed"
        assert rollback(url, store, "offpath", 1) == 1
        got: dict[str, Any] = state(0.0, 0)
        ckpt.restore(got, step=2)
        assert ckpt.epoch == 0
        with pytest.raises(Superseded):
            ckpt.save(3, state(3.0, 3)).wait(30)
        ckpt.restore(got, step=1)
        assert ckpt.epoch == 1
        assert ckpt.save(3, state(3.0, 3)).wait(30).state == "committed"


def test_a_damaged_timeline_is_replaced_by_an_operators_rollback(
    where: tuple[str, Path], tmp_path: Path
) -> None:
    """A damaged timeline document stops the job's saves, each error saying how to get
    out; `ckptd rollback JOB STEP` (through a server, or on the store itself) starts
    a new timeline and the job carries on."""
    import subprocess
    import sys
    import time

    from ckptd.errors import StoreCorrupt
    from ckptd.format import timeline_key

    url, store = where
    job = "damaged"
    with Checkpointer(url, job, chunk_size=4096, shm_dir=tmp_path / "shm",
                      serve_peers=False, timeout=30.0) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, state(float(step), step)).wait(30).state == "committed"
        assert rollback(url, store, job, 2) == 1
        got: dict[str, Any] = state(0.0, 0)
        ckpt.restore(got, step=2)
        (store / timeline_key(job)).write_bytes(b"\0" * 40)  # a torn write
        before = int(time.time())
        with pytest.raises(StoreCorrupt) as info:
            ckpt.save(3, state(3.0, 3)).wait(30)
        assert f"ckptd rollback {job} STEP" in info.value.message
        out = subprocess.run([sys.executable, "-m", "ckptd", "rollback", job, "2", "--url",
                              url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "roll back to step 2" in " ".join(out.stdout.split())
        ckpt.restore(got, step=2)
        assert ckpt.save(3, state(3.0, 3)).wait(30).state == "committed"
    kept = RankManifest.parse((store / manifest_key(job, 3, 0)).read_bytes())
    assert kept.meta["epoch"] > before  # above the damaged one (1), that no manifest showed


def test_a_process_started_after_a_rollback_goes_back_to_its_step(
    where: tuple[str, Path], tmp_path: Path
) -> None:
    """(Found by a probe.) Steps 1 and 3 committed; an operator rolls the job back
    to step 1; its processes start again. One that saves before restoring
    anything is refused, and the rollback stands. One that restores "latest" gets
    step 1, the rollback's, and trains on; once step 2 of the new path commits,
    "latest" is step 2, though step 3 of the abandoned path stays committed.
    Before, the first committed (its checkpointer took the new timeline at start)
    and erased the rollback; the second restored step 3 and every restart raised
    RollbackRequested; and after the rollback ended, restarts restored step 3."""
    url, store = where
    job = "operator"
    with Checkpointer(url, job, chunk_size=4096, shm_dir=tmp_path / "shm",
                      serve_peers=False, timeout=30.0) as ckpt:
        for step in (1, 3):
            assert ckpt.save(step, state(float(step), step)).wait(30).state == "committed"
    assert rollback(url, store, job, 1) == 1

    def restart(shm: str) -> Checkpointer:
        return Checkpointer(url, job, chunk_size=4096, shm_dir=tmp_path / shm,
                            serve_peers=False, timeout=30.0)

    with restart("eager") as eager, pytest.raises(Superseded):
        eager.save(4, state(4.0, 4)).wait(30)
    with restart("loop") as loop:
        assert loop.latest() == 1  # the steps after the rollback's were abandoned
        got: dict[str, Any] = state(0.0, 0)
        assert loop.restore(got).step == 1 and got["step"] == 1
        assert torch.equal(got["w"], state(1.0, 1)["w"]) and loop.epoch == 1
        loop.step(2, loss=0.5)  # no RollbackRequested: this rank went back
        assert loop.save(2, state(-2.0, 2)).wait(30).state == "committed"
        assert loop.latest() == 2
    with restart("again") as again:
        assert again.restore(got).step == 2 and torch.equal(got["w"], state(-2.0, 2)["w"])
        with pytest.raises(AlreadyCommitted, match="on the path a rollback left"):
            again.save(3, state(-3.0, 3)).wait(30)  # (a step number commits once)
        assert again.save(4, state(4.0, 4)).wait(30).state == "committed"
        assert again.latest() == 4


def test_a_rollback_to_a_damaged_step_is_refused(where: tuple[str, Path],
                                                  tmp_path: Path) -> None:
    """(Found by a probe.) Every rank would be sent back to a step it cannot
    restore: the rollback is refused naming the damaged document, and nothing
    changes (no marker, no new timeline)."""
    import asyncio

    from ckptd.client.transport import open_transport
    from ckptd.errors import StoreCorrupt

    url, store = where
    job = "tohurt"
    with Checkpointer(url, job, chunk_size=4096, shm_dir=tmp_path / "shm",
                      serve_peers=False, timeout=30.0) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, state(float(step), step)).wait(30).state == "committed"
    damaged = store / manifest_key(job, 2, 0)
    damaged.write_bytes(damaged.read_bytes()[:40])
    if url.startswith("http"):
        reply = httpx.post(f"{url}/v1/jobs/{job}/rollback", json={"step": 2}, timeout=30)
        assert reply.status_code == 500 and reply.json()["code"] == "store_corrupt"
        assert manifest_key(job, 2, 0) in reply.text, reply.text
    else:
        with pytest.raises(StoreCorrupt) as info:
            rollback(url, store, job, 2)
        assert info.value.detail["key"] == manifest_key(job, 2, 0)
    async def now() -> tuple[int | None, int]:
        transport = open_transport(url, job=job)
        try:
            return await transport.rollback_state(job)
        finally:
            await transport.close()

    assert asyncio.run(now()) == (None, 0)
    assert rollback(url, store, job, 1) == 1  # an intact step is fine


def test_the_new_path_replays_the_step_numbers_of_the_one_it_left_and_goes_on(
    where: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 10, 20 and 30 committed; an operator rolls back to 10; the job trains
    from 10 again and saves every 10 steps. Its save of 20 (a number the abandoned
    path committed) failed with already_committed, and the next save() raised it:
    the README loop died at its first save after the rollback. Now that save is
    skipped with a warning that says why, and the job goes on to commit 40. A save
    at a number the current path holds (10, below the rollback's) still raises."""
    url, store = where
    job = "replay"

    def checkpointer(shm: str) -> Checkpointer:
        return Checkpointer(url, job, chunk_size=4096, shm_dir=tmp_path / shm,
                            serve_peers=False, timeout=30.0)

    with checkpointer("first") as ckpt:
        for step in (10, 20, 30):
            assert ckpt.save(step, state(float(step), step)).wait(30).state == "committed"
    assert rollback(url, store, job, 10) == 1
    with checkpointer("loop") as loop:
        got: dict[str, Any] = state(0.0, 0)
        assert loop.restore(got).step == 10
        first = loop.save(20, state(-20.0, 20))  # as the loop saves: not waited on
        deadline = time.monotonic() + 30
        while not first.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # (its failure is recorded by the snapshot's done-callback)
        loop.step(21, loss=0.5)  # no raise: the job goes on
        second = loop.save(30, state(-30.0, 30))
        with pytest.raises(AlreadyCommitted, match="on the path a rollback left"):
            second.wait(30)  # (one who waits is told)
        assert loop.save(40, state(-40.0, 40)).wait(30).state == "committed"
        assert loop.latest() == 40
        assert "this save is skipped" in caplog.text
        assert loop.close().failed == 2
    with checkpointer("mistake") as again:
        again.restore(got)
        again.save(10, state(-10.0, 10))  # the current path's own step: a mistake
        with pytest.raises(AlreadyCommitted):
            again.save(50, state(-50.0, 50)).wait(30)
