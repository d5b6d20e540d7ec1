"""A transport's staging pool outlives nothing: removed at shutdown, at the
interpreter's exit, by a watcher process after a death by a signal, and by the next
transport on the host for a process gone otherwise."""

from __future__ import annotations

import atexit
import logging
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

from ckptd import knobs
from ckptd.errors import CkptdError

from ...staging import pool as _staging_pool  # noqa: F401  (its exit hook first: ours runs before)
from ...staging.inventory import list_pools, remove_dead_pools

log = logging.getLogger(__name__)

# A transport's pool is job ``torchft-<8 hex>``, rank 0: named at random, so no later
# process ever finds it again, and its owner's death leaves nothing to restore from.
_POOL_JOB = re.compile(r"torchft-[0-9a-f]{8}")
# The watcher each transport starts (``_watch``): it waits, signals ignored, until its
# transport's process is gone (its stdin, a pipe only that process holds, ends), then
# removes the pool once no process holds its lock (``ckptd shm --clean``'s removal).
# The lock goes with the process's last descriptor of the control file, which the
# kernel may close after the pipe's: asked again for a moment.
_WATCHER = """\
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
sys.stdin.buffer.read()
root, job = sys.argv[1:3]
for _ in range(40):
    if not os.path.isdir(os.path.join(root, "ckptd-%d" % os.getuid(), job)):
        break
    from ckptd.client.staging.inventory import remove_dead_pools
    remove_dead_pools(root, job=job, all_users=False)
    time.sleep(0.05)
"""


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # the transports up (their shutdown)


# A forked child (os.fork, not multiprocessing's, which skips atexit) that exits
# must not remove the pools of its parent's transports.
os.register_at_fork(after_in_child=_LIVE.clear)


@atexit.register  # (after staging's own hook was registered: so it runs before it)
def _shut_down_at_exit() -> None:
    """Removes the pools of transports still up at the interpreter's exit. Staging
    keeps a pool when the exit is an uncaught exception, for a restart to restore
    from; a transport's pool is named at random, no restart finds it."""
    for transport in list(_LIVE):
        try:
            transport.shutdown(wait=False)
        except Exception as exc:  # exiting: report, never raise
            log.warning("torchft: removing the staging pool at exit failed: %s", exc)


def _watch(root: Path, job: str) -> subprocess.Popen[bytes] | None:
    """Starts the watcher that removes this transport's pool once its process is
    gone by a signal (``_WATCHER``); None when it cannot start (a transport starting
    later on the host removes the pool instead)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(root), job], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, ValueError) as exc:
        log.debug("torchft: no watcher for the staging pool %s: %s", job, exc)
        return None


def _reap_dead_pools(root: Path) -> None:
    """Removes the pools that transports of processes now gone left under ``root``
    (this user's; a pool is dead when no process holds its lock, which ``ckptd shm``
    asks the same way and which holds across PID namespaces)."""
    removed = []
    try:
        pools, _ = list_pools(root, all_users=False)
        for job in sorted({p.job for p in pools
                           if not p.alive and p.rank == 0 and _POOL_JOB.fullmatch(p.job)}):
            removed += remove_dead_pools(root, job=job, all_users=False)[0]
    except (OSError, CkptdError) as exc:
        log.debug("torchft: looking for dead transports' pools under %s: %s", root, exc)
    if removed:
        log.info("torchft: removed %d staging pools (%s) of transports whose processes are "
                 "gone", len(removed), knobs.human_bytes(sum(p.nbytes for p in removed)))
