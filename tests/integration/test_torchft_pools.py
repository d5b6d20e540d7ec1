"""A ``CkptdTransport``'s staging pool (a whole copy of the model's state in
``/dev/shm``) does not outlive its process, however the process ends: at the
interpreter's exit on an uncaught exception, by the transport's watcher after a
SIGTERM or a SIGKILL, and, when even the watcher was killed, by the next transport
that starts on the host. Only transports' dead pools are taken: a live one stays
whatever pid its control file holds (its owner may be in another PID namespace),
and so does a crashed worker's pool, which its restart restores from."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("torchft", reason="pip install 'ckptd[torchft]'")

from ckptd.client.integrations.torchft import CkptdTransport  # noqa: E402
from ckptd.client.staging.format import PID_AT  # noqa: E402
from ckptd.client.staging.inventory import list_pools  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# A process with a transport that sent a 1 MiB state; then it ends as argv[1] says,
# or ("wait") prints what the test needs and waits for its stdin to end.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from datetime import timedelta
    import torch
    from ckptd.client.integrations.torchft import CkptdTransport
    from ckptd.client.staging.pool import StagingPool
    how, root = sys.argv[1:3]
    t = CkptdTransport(60, shm_dir=root, host="127.0.0.1")
    t.send_checkpoint([1], 1, {"w": torch.ones(1 << 18)}, timedelta(seconds=30))
    if how == "exception":
        raise RuntimeError("training crashed")
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "worker":  # and a crashed worker's pool, kept for its restart
        worker = StagingPool("torchft-llama", 0, root=root)
        worker.stage(worker.prepare([("w", torch.ones(1024))], 4096), 0, 5)
    watcher = getattr(t, "_watcher", None)
    print(watcher.pid if watcher is not None else 0, t._pool.directory, flush=True)
    sys.stdin.read()
""")


def _start(how: str, root: Path) -> subprocess.Popen[str]:
    root.mkdir()
    return subprocess.Popen([sys.executable, "-c", CHILD, how, str(root)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _gone_within(root: Path, seconds: float) -> list[Path]:
    """The files left under ``root`` once none are, or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while _files(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _files(root)


def test_a_transport_that_dies_leaves_no_pool(shm: Path) -> None:
    """Each of these left its 1 MiB pool for good (a torchft process that dies
    leaked a whole copy of the state): an uncaught exception (removed before the
    process ends) and SIGTERM (removed by the watcher, as after a SIGKILL: it sees
    its pipe from the process end either way)."""
    children = {how: _start(how, shm / how) for how in ("exception", "sigterm")}
    for child in children.values():
        child.communicate(timeout=45)
    codes = {how: child.returncode for how, child in children.items()}
    left = _files(shm / "exception")  # at once: the exit removed it, not the watcher
    assert codes == {"exception": 1, "sigterm": -signal.SIGTERM}
    assert left == []
    assert _gone_within(shm / "sigterm", 10) == []


def test_a_new_transport_removes_only_dead_transports_pools(shm: Path) -> None:
    """A transport whose watcher was killed with it (a process group's SIGKILL) left
    its pool; the next transport on the host removes it, and nothing else: not a
    live transport's pool whose control file names a pid that is dead here (its
    process is in another PID namespace), not a crashed worker's pool."""
    dead, live = _start("worker", shm / "dead"), _start("wait", shm / "live")
    children = [dead, live]
    try:
        lines = [child.stdout.readline().split() for child in children]  # type: ignore[union-attr]
        assert all(len(line) == 2 for line in lines), lines
        (watcher, dead_pool), (_, live_pool) = lines
        if int(watcher):  # (the old code had none)
            os.kill(int(watcher), signal.SIGKILL)
        dead.kill()
        assert dead.wait(10) == -signal.SIGKILL
        assert Path(dead_pool, "control").is_file()
        with open(Path(live_pool, "control"), "r+b") as f:
            f.seek(PID_AT)
            f.write(struct.pack("<Q", _dead_pid()))
        for root in (shm / "dead", shm / "live"):
            CkptdTransport[Any](shm_dir=str(root), host="127.0.0.1").shutdown()
        assert not Path(dead_pool).exists()
        assert Path(live_pool, "control").is_file()
        assert [(p.job, p.alive) for p in list_pools(shm / "dead")[0]] == [
            ("torchft-llama", False)]
    finally:
        for child in children:
            child.kill()
            child.communicate(timeout=10)


def _dead_pid() -> int:
    """The pid of a child that has exited and been waited for: no process has it
    now (short of reuse)."""
    child = subprocess.Popen(["true"])
    child.wait(10)
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    return child.pid
