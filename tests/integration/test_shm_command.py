"""``ckptd shm`` lists this host's staging pools (a crashed worker's and a live one's:
job, rank, size, owner alive or dead, step held) and ``--clean`` removes the dead
ones only, also when a process claims a dead pool's name while it cleans."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer
from ckptd.client.staging import StagingPool, pool_dir
from ckptd.client.staging.format import CONTROL_NAME
from ckptd.client.staging.inventory import list_pools, remove_dead_pools

pytestmark = pytest.mark.timeout(120)

GOLDEN_POOL = Path(__file__).resolve().parents[1] / "data" / "golden-pool-v1"

CRASH = """
import os, sys, torch
from ckptd.client import Checkpointer
ckpt = Checkpointer(sys.argv[1], "crashed", rank=1, world_size=2, chunk_size=4096,
                    shm_dir=sys.argv[2], serve_peers=False)
ckpt.save(3, {"w": torch.arange(20_000, dtype=torch.float32)}).wait(timeout=60)
print(os.getpid(), flush=True)
os._exit(0)  # killed: the pool stays for the restart
"""


def ckptd(shm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_SHM_DIR"] = str(shm)
    return subprocess.run([sys.executable, "-m", "ckptd", "shm", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def listed(shm: Path, *args: str) -> dict[str, Any]:
    """``ckptd shm --json`` run in this process (the lock probe of a pool this process
    owns still sees it held: flock locks belong to open files, not processes)."""
    done = CliRunner().invoke(app, ["shm", "--json", "--shm-dir", str(shm), *args])
    assert done.exit_code == 0, done.output
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


@pytest.fixture
def crashed(tmp_path: Path, shm: Path) -> int:
    """A worker that saved step 3 and died: its pool, and its pid."""
    store = f"file://{tmp_path / 'store'}"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CRASH), store, str(shm)],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_shm_lists_live_and_dead_pools_and_cleans_only_the_dead(
    tmp_path: Path, shm: Path, crashed: int
) -> None:
    store = f"file://{tmp_path / 'store'}"
    with Checkpointer(store, "live", chunk_size=4096, shm_dir=shm, serve_peers=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(5000)}).wait(timeout=60)

        pools = {p["job"]: p for p in listed(shm)["pools"]}
        assert sorted(pools) == ["crashed", "live"]
        dead, live = pools["crashed"], pools["live"]
        assert (dead["rank"], dead["alive"], dead["pid"], dead["step"]) == (1, False, crashed, 3)
        assert dead["restorable"] and dead["state"] == "staged"
        assert dead["bytes"] >= 80_000  # the staged tensor's pages
        assert dead["directory"] == str(pool_dir("crashed", 1, shm))
        assert (live["alive"], live["pid"], live["step"]) == (True, os.getpid(), 1)

        # Plain text off a terminal: one line per pool, the directory whole.
        text = ckptd(shm)
        assert text.returncode == 0, text.stderr
        row = next(line for line in text.stdout.splitlines() if "crashed" in line)
        assert "dead" in row and f"pid {crashed}" in row and str(pool_dir("crashed", 1, shm)) in row

        # A recent dead pool is what a restart restores from: --older-than keeps it.
        doc = listed(shm, "--clean", "--older-than", "1h")
        assert doc["removed"] == [] and len(doc["pools"]) == 2

        doc = listed(shm, "--clean")
        assert [p["job"] for p in doc["removed"]] == ["crashed"]
        assert [p["job"] for p in doc["pools"]] == ["live"]
        assert not pool_dir("crashed", 1, shm).exists()
        assert not pool_dir("crashed", 1, shm).parent.exists()  # the empty job directory
        # The live pool is untouched and goes on staging.
        assert ckpt.save(2, {"w": torch.full((5000,), 2.0)}).wait(timeout=60).state == "committed"
        assert (ckpt.staging.directory / CONTROL_NAME).exists()
    assert listed(shm)["pools"] == []


def test_shm_says_what_it_did_in_plain_words(shm: Path, crashed: int) -> None:
    # (found by a probe: "no staging pools" while another job's pool was there)
    other = CliRunner().invoke(app, ["shm", "--shm-dir", str(shm), "--job", "other"]).stdout
    assert f"no staging pools of job other under {shm}" in other, other
    done = ckptd(shm, "--clean")
    assert done.returncode == 0, done.stderr
    assert f"removed {pool_dir('crashed', 1, shm)} (job crashed rank 1" in done.stdout
    assert "1 removed" in done.stdout
    assert "no staging pools" in CliRunner().invoke(app, ["shm", "--shm-dir", str(shm)]).stdout
    bad = ckptd(shm, "--older-than", "soon", "--clean")
    assert bad.returncode == 2 and "not an age" in bad.stderr


def test_shm_names_a_user_directory_ranks_refuse_to_stage_in(
        shm: Path, tmp_path: Path) -> None:
    """A ``ckptd-<uid>`` that is a link, a file, or another user's directory: every
    rank of that uid refuses to stage there (and says so); ``ckptd shm`` said "no
    staging pools" and nothing of it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (shm / f"ckptd-{os.getuid()}").symlink_to(elsewhere)
    (shm / "ckptd-4242").write_text("")
    (shm / "ckptd-4343").mkdir()  # (made by this user, named for another)
    done = ckptd(shm)
    assert done.returncode == 0, done.stderr
    assert "no staging pools" in done.stdout
    said = " ".join(done.stderr.split())
    assert f"{shm}/ckptd-{os.getuid()} is a symbolic link (to {elsewhere})" in said, said
    assert f"{shm}/ckptd-4242 is not a directory" in said
    assert f"{shm}/ckptd-4343 belongs to uid {os.getuid()}, not to uid 4343" in said
    assert "remove it" in said and "CKPTD_SHM_DIR" in said
    assert "Traceback" not in done.stderr
    assert len(listed(shm)["refused"]) == 3
    mine = listed(shm, "--mine")["refused"]
    assert mine == [f"{shm}/ckptd-{os.getuid()} is a symbolic link (to {elsewhere})"]


def _dead_pool(shm: Path, job: str, rank: int) -> Path:
    """A dead owner's pool (the golden pool of format version 1, copied)."""
    d = pool_dir(job, rank, shm)
    d.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(GOLDEN_POOL, d)
    return d


def test_clean_keeps_a_pool_a_process_claims_while_it_runs(shm: Path) -> None:
    """A worker restarting (claiming its rank's dead pool) while a clean runs: whoever
    wins, the worker's pool is whole afterwards and under the rank's own name."""
    for attempt in range(30):
        primary = _dead_pool(shm, "race", 0)
        start = threading.Barrier(2)
        claimed: list[StagingPool] = []

        def claim(start: threading.Barrier, claimed: list[StagingPool]) -> None:
            start.wait()
            claimed.append(StagingPool("race", 0, root=shm))

        t = threading.Thread(target=claim, args=(start, claimed))
        t.start()
        start.wait()
        remove_dead_pools(shm, job="race")
        t.join(timeout=30)
        (pool,) = claimed
        try:
            assert pool.directory == primary, (attempt, pool.directory)
            control = pool.directory / CONTROL_NAME
            assert os.stat(control).st_ino == os.fstat(pool._res.fd).st_ino, attempt
            pool.prepare([("w", torch.ones(100))], 4096)  # and it still works
            (info,) = list_pools(shm, job="race")[0]
            assert info.alive
        finally:
            pool.close()
        shutil.rmtree(shm / f"ckptd-{os.getuid()}", ignore_errors=True)


def test_clean_asks_again_before_it_removes(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed dead, then claimed by a restarting worker before the removal: kept."""
    from ckptd.client.staging import inventory

    primary = _dead_pool(shm, "late", 0)
    claimed: list[StagingPool] = []
    real = inventory.list_pools

    def list_then_claim(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        assert [p.alive for p in found[0]] == [False]
        claimed.append(StagingPool("late", 0, root=shm))  # the restart, just now
        return found

    monkeypatch.setattr(inventory, "list_pools", list_then_claim)
    removed, kept = inventory.remove_dead_pools(shm)
    (pool,) = claimed
    try:
        assert removed == [] and [p.directory for p in kept] == [primary]
        assert pool.directory == primary
        assert os.stat(primary / CONTROL_NAME).st_ino == os.fstat(pool._res.fd).st_ino
    finally:
        pool.close()


# -- root cleans every user's pools, in directories those users write --------------------


def test_a_fifo_in_a_pool_does_not_hang_the_listing(shm: Path) -> None:
    """A user's FIFO named ``control`` (or ``index.json``) blocked every open for
    reading: root's ``ckptd shm`` in an init container never returned."""
    for name, rank in ((CONTROL_NAME, 0), ("index.json", 1)):
        d = _dead_pool(shm, "fifo", rank)
        (d / name).unlink()
        os.mkfifo(d / name)
    found: list[Any] = []
    t = threading.Thread(target=lambda: found.append(list_pools(shm)), daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():  # release it (a writer opening the FIFO) before failing
        for rank in (0, 1):
            for name in (CONTROL_NAME, "index.json"):
                with contextlib.suppress(OSError):
                    os.close(os.open(pool_dir("fifo", rank, shm) / name,
                                     os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=20)
        pytest.fail("listing pools blocked on a FIFO")
    pools = {p.rank: p for p in found[0][0]}
    assert pools[0].alive  # a control file that cannot be asked: never removed
    assert not pools[1].alive and pools[1].step is None  # no index read
    removed, _ = remove_dead_pools(shm, job="fifo")
    assert [p.rank for p in removed] == [1] and pool_dir("fifo", 0, shm).is_dir()


def _swap_after_listing(monkeypatch: pytest.MonkeyPatch, swap: Any) -> None:
    """Runs ``swap`` (the other user's move) between the listing and the removal."""
    from ckptd.client.staging import inventory

    real = inventory.list_pools

    def list_then_swap(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        assert [p.alive for p in found[0]] == [False]
        swap()
        return found

    monkeypatch.setattr(inventory, "list_pools", list_then_swap)


def test_clean_writes_nothing_through_a_control_file_swapped_for_a_link(
        shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed dead, then its control file made a link to a file of root's: the removal
    opened it for writing, through the link, and wrote its magic into that file."""
    d = _dead_pool(shm, "link", 0)
    victim = tmp_path / "shadow"
    victim.write_bytes(b"root:$6$hash:19000:0:99999:7:::\n")
    before = victim.read_bytes()

    def swap() -> None:
        (d / CONTROL_NAME).unlink()
        (d / CONTROL_NAME).symlink_to(victim)

    _swap_after_listing(monkeypatch, swap)
    removed, _ = remove_dead_pools(shm)
    assert victim.read_bytes() == before
    assert removed == [] and (d / CONTROL_NAME).is_symlink()


def test_clean_unlinks_nothing_through_a_pool_swapped_for_a_link(
        shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed dead, then the pool directory made a link to another directory (that
    holds an unlocked ``control``): the removal emptied that directory."""
    d = _dead_pool(shm, "dirlink", 0)
    elsewhere = tmp_path / "etc"
    shutil.copytree(GOLDEN_POOL, elsewhere)
    (elsewhere / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    kept = sorted(os.listdir(elsewhere))

    def swap() -> None:
        d.rename(d.with_name("moved"))
        d.symlink_to(elsewhere, target_is_directory=True)

    _swap_after_listing(monkeypatch, swap)
    removed, _ = remove_dead_pools(shm)
    assert sorted(os.listdir(elsewhere)) == kept
    assert removed == []


def test_shm_does_not_import_torch(shm: Path) -> None:
    """An init container or a node's boot runs ``ckptd shm``: it imported torch
    (seconds, and a CUDA image's libraries) to read a few small files."""
    _dead_pool(shm, "light", 0)
    code = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["ckptd", "shm", "--json", "--clean", "--shm-dir", sys.argv[1]]
        try:
            runpy.run_module("ckptd", run_name="__main__")
        except SystemExit as exc:
            assert not exc.code, exc.code
        print("torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(shm)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc, imported = done.stdout.rsplit("\n", 2)[:2]
    assert [p["job"] for p in json.loads(doc)["removed"]] == ["light"]
    assert imported == "False"
