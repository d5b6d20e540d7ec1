"""``latest()`` is the step a restore of latest uses, over ``file://`` as over a
server; a job whose committed steps are all damaged raises ``StoreCorrupt``
naming the damage, never "no checkpoint" (which the restart idiom reads as
"train from step 0")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import StoreCorrupt
from tests.conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)

Damage = Callable[[Path], None]


def commit_record(root: Path, step: int) -> Path:
    return root / "jobs" / "j" / "steps" / str(step) / "commit.json"


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


@contextmanager
def stores(tmp_path: Path, shm: Path, damage: Damage) -> Iterator[list[str]]:
    """Steps 1 to 3 of job ``j``, damaged by ``damage``, as a ``file://`` url and
    a server's."""
    root = tmp_path / "store"
    with Checkpointer(f"file://{root}", "j", shm_dir=shm) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((8,), float(step))}).wait(60)
    damage(root)
    srv = ServerProcess(store=root)
    srv.start()
    try:
        yield [f"file://{root}", srv.url]
    finally:
        srv.stop()


def opened(url: str, shm: Path) -> Checkpointer:
    return Checkpointer(url, "j", shm_dir=shm, serve_peers=False, heartbeat_interval=0,
                        timeout=60)


def test_latest_is_the_step_a_restore_uses_past_a_damaged_commit_record(
    tmp_path: Path, shm: Path
) -> None:
    with stores(tmp_path, shm, lambda root: cut(commit_record(root, 3))) as urls:
        for url in urls:
            with opened(url, shm) as ckpt:
                assert ckpt.latest() == 2, url
                state = {"w": torch.zeros(8)}
                assert ckpt.restore(state).step == 2, url
                assert torch.equal(state["w"], torch.full((8,), 2.0))


def test_latest_is_the_step_a_restore_uses_past_a_damaged_latest_ref(
    tmp_path: Path, shm: Path
) -> None:
    def garbage_ref(root: Path) -> None:
        (root / "jobs" / "j" / "refs" / "latest").write_bytes(b"\x00garbage{")

    with stores(tmp_path, shm, garbage_ref) as urls:
        for url in urls:
            with opened(url, shm) as ckpt:
                assert ckpt.latest() == 3, url
                assert ckpt.restore({"w": torch.zeros(8)}).step == 3, url


def test_a_job_whose_steps_are_all_damaged_is_store_corrupt_not_empty(
    tmp_path: Path, shm: Path
) -> None:
    def all_records(root: Path) -> None:
        for step in (1, 2, 3):
            cut(commit_record(root, step))

    damaged = {f"jobs/j/steps/{s}/commit.json" for s in (1, 2, 3)}
    with stores(tmp_path, shm, all_records) as urls:
        for url in urls:
            with opened(url, shm) as ckpt:
                with pytest.raises(StoreCorrupt) as err:
                    ckpt.latest()
                assert err.value.detail["key"] in damaged, url
                with pytest.raises(StoreCorrupt) as err:
                    ckpt.restore({"w": torch.zeros(8)})
                assert err.value.detail["key"] in damaged, url
