"""``ckptd gc`` through a list of replicas follows its collection on the replica
running it; when that one dies, the next replica answers and does not know the
collection. (An operator's probe: the command ended ``[invalid_request] the server no
longer knows collection ... (was it restarted?)``, exit 2 as a mistake of the
caller's, with no word of where the store stands.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.cluster.conftest import Replica


def test_a_collection_whose_replica_died_is_said_as_lost_with_where_to_look(
        static_pair: tuple[Replica, Replica]) -> None:
    a, b = static_pair
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "gc", "--grace", "60", "--url",
                             f"{a.url},{b.url}"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            running = [r for r in (a, b)
                       if httpx.get(f"{r.url}/v1/gc", timeout=10).json()["running"]]
            if running:
                break
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        (collecting,) = running
        collecting.stop(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err
    assert "[unavailable]" in err and "is not known to the server that answered" in err, err
    assert "ckptd status" in err and "Traceback" not in err, err
