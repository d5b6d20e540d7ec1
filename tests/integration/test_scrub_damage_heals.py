"""A step scrub marked damaged is whole again once its damaged chunks read good:
repaired from a replica (``ckptd scrub --replica``, a server's
``CKPTD_SCRUB_REPLICA``) or put back by hand and read good by a later scrub. Found
by a probe: the marker (``jobs/<job>/damage/<step>.json``) stayed for good, so
``ckptd ls`` kept the repaired step damaged (exit 1) and a restore of latest kept
skipping it; only ``ckptd forget --step`` cleared it, by deleting the step."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from ckptd.lifecycle.documents import damage_key
from ckptd.repository import Repository
from ckptd.store import LocalStore
from tests.conftest import ServerProcess
from tests.integration.test_cli_damage_exits import WIDE, _row
from tests.integration.test_cli_mistakes import ckptd
from tests.integration.test_scrub_runs import JOB, _fill

pytestmark = pytest.mark.timeout(180)



@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of steps 1, 2, 3 (each its own chunks): the replica repaired from."""
    root = tmp_path_factory.mktemp("pristine") / "store"
    asyncio.run(_fill(root))
    return root


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


def _chunks_of_step_3(root: Path) -> list[Path]:
    """The chunk files of rank 0's model.w in step 3 (no other step names them)."""
    manifest = json.loads((root / "jobs" / JOB / "steps" / "3" / "ranks" / "0.json"
                           ).read_text())
    ids = next(e for e in manifest["entries"] if e["name"] == "model.w")["chunks"]
    return [root / "chunks" / cid[:2] / cid for cid in ids]


def _corrupt(chunk: Path) -> None:
    chunk.chmod(0o644)
    data = chunk.read_bytes()
    chunk.write_bytes(bytes([data[0] ^ 1]) + data[1:])


def _latest(root: Path) -> int | None:
    """The step a restore of latest gets (a step scrub marked is skipped)."""
    async def read() -> int | None:
        repo = Repository(LocalStore(root, create=False))
        try:
            return await repo.latest(JOB)
        finally:
            await repo.close()

    return asyncio.run(read())


def _marked_damaged(url: str, store: Path) -> Path:
    """Scrubs ``url`` with no copy to repair from: step 3 is marked damaged."""
    done = ckptd("scrub", "--url", url, env=WIDE)
    assert done.returncode == 1, done.stdout + done.stderr
    marker = store / damage_key(JOB, 3)
    assert marker.exists(), done.stdout + done.stderr
    listed = ckptd("ls", JOB, "--url", f"file://{store}", env=WIDE)
    assert listed.returncode == 1 and _row(listed.stdout, 3)[1] == "damaged", listed.stdout
    assert _latest(store) == 2
    return marker


def _whole(url: str, store: Path) -> None:
    """Step 3 listed committed, ls exit 0, and a restore of latest gets it."""
    listed = ckptd("ls", JOB, "--url", url, env=WIDE)
    said = listed.stdout + listed.stderr
    assert listed.returncode == 0, said
    assert _row(listed.stdout, 3)[1] == "committed", said
    assert not (store / damage_key(JOB, 3)).exists(), said
    assert _latest(store) == 3


def test_a_step_repaired_by_scrub_replica_is_whole_again(store: Path, pristine: Path) -> None:
    chunk = _chunks_of_step_3(store)[0]
    _corrupt(chunk)
    srv = ServerProcess(store=store)
    srv.start()
    try:
        _marked_damaged(srv.url, store)
        repaired = ckptd("scrub", "--url", f"file://{store}", "--replica", str(pristine),
                         env=WIDE)
        said = repaired.stdout + repaired.stderr
        assert repaired.returncode == 0 and f"repaired {chunk.name}" in said, said
        assert f"whole again {JOB} steps [3]" in said, said
        verified = ckptd("verify", JOB, "--url", srv.url, env=WIDE)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        _whole(srv.url, store)
    finally:
        srv.stop()


def test_a_server_repairing_from_its_scrub_replica_makes_the_step_whole(
    store: Path, pristine: Path
) -> None:
    """(Also: a server opens CKPTD_SCRUB_REPLICA, a directory, and repairs from it.)"""
    chunk = _chunks_of_step_3(store)[0]
    _corrupt(chunk)
    _marked_damaged(f"file://{store}", store)
    srv = ServerProcess(store=store, env={"CKPTD_SCRUB_REPLICA": str(pristine)})
    srv.start()
    try:
        repaired = ckptd("scrub", "--url", srv.url, env=WIDE)
        said = repaired.stdout + repaired.stderr
        assert repaired.returncode == 0 and f"repaired {chunk.name}" in said, said
        assert f"whole again {JOB} steps [3]" in said, said  # (through the server's answer)
        _whole(srv.url, store)
    finally:
        srv.stop()


def test_a_chunk_put_back_by_hand_is_read_good_and_its_step_whole_again(
    store: Path, pristine: Path
) -> None:
    """Two chunks of step 3 corrupt: one put back leaves the other marked (the step
    still damaged); both put back, a scrub reads them good and the marker goes."""
    first, second = _chunks_of_step_3(store)[:2]
    _corrupt(first)
    _corrupt(second)
    marker = _marked_damaged(f"file://{store}", store)
    assert sorted(json.loads(marker.read_text())["chunks"]) == sorted([first.name, second.name])
    for chunk, still in ((first, [second.name]), (second, None)):
        chunk.write_bytes((pristine / chunk.relative_to(store)).read_bytes())
        done = ckptd("scrub", "--url", f"file://{store}", env=WIDE)
        said = done.stdout + done.stderr
        if still is None:
            assert done.returncode == 0, said
            _whole(f"file://{store}", store)
        else:
            assert done.returncode == 1 and second.name in said, said  # (still corrupt)
            assert json.loads(marker.read_text())["chunks"] == still, said
            assert _latest(store) == 2
