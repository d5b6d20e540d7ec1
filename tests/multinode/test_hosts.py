"""The simulated hosts themselves: each its own name, /etc/hosts and /dev/shm;
a killed host takes every process and its shared memory with it; a cut link
times out (no reset), a slow link delays; nothing outlives the run, not even a
run that is SIGKILLed; two runs at once never meet."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multinode.conftest import ROOT, hosts_unavailable
from tests.multinode.hosts import Cluster, Host, HostProcess

pytestmark = [pytest.mark.timeout(120)]


def serve_http(host: Host, port: int = 8000) -> HostProcess:
    proc = host.run([sys.executable, "-m", "http.server", str(port), "--bind", host.address],
                    log=f"http-{port}.log")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            host.call(socket.create_connection, (host.address, port), 1.0).close()
            return proc
        except OSError:
            assert proc.poll() is None, proc.log()
            time.sleep(0.1)
    raise AssertionError(f"http.server on {host.name} did not answer: {proc.log()}")


def fetch(host: Host, url: str, timeout: float = 5.0) -> tuple[str, float]:
    """curl from ``host``: (HTTP status or the curl error, seconds)."""
    start = time.monotonic()
    done = subprocess.run(host.ns.nsenter("curl", "-s", "-o", "/dev/null", "-m", str(timeout),
                                          "-w", "%{http_code}", url),
                          capture_output=True, timeout=timeout + 10)
    took = time.monotonic() - start
    return (done.stdout.decode() if done.returncode == 0 else f"curl exit {done.returncode}",
            took)


def test_each_host_has_its_own_name_addresses_and_shared_memory(cluster: Cluster) -> None:
    one, two = cluster.add_host("node1"), cluster.add_host("node2")
    assert one.sh("hostname").strip() == "node1" and two.sh("hostname").strip() == "node2"
    assert one.sh("getent hosts node2").split()[0] == "198.18.0.2"
    assert "198.18.0.1/24" in one.sh("ip -br addr show eth0")
    one.sh("echo one > /dev/shm/mark")
    assert two.sh("ls -A /dev/shm") == "" and not Path("/dev/shm/mark").exists()
    assert one.sh("cat /dev/shm/mark").strip() == "one"
    mounts = one.sh("grep ' /dev/shm ' /proc/self/mounts")
    assert f"ckptd-{cluster.run_id}-node1 /dev/shm tmpfs" in mounts
    # /proc shows the host's processes only: its init, and the shell asking and its pipe.
    assert int(one.sh("ls /proc | grep -c '^[0-9]'")) <= 4
    serve_http(one)
    assert fetch(two, "http://node1:8000/")[0] == "200"


def test_killing_a_host_takes_its_processes_and_its_memory(cluster: Cluster) -> None:
    one, two = cluster.add_host("node1"), cluster.add_host("node2")
    server = serve_http(one)
    sleeper = one.run(["sh", "-c", "sleep 600 & sleep 600"], log="sleep.log")
    other = two.run(["sleep", "600"], log="sleep.log")
    frozen = one.run(["sleep", "600"], log="frozen.log")
    frozen.signal(signal.SIGSTOP)  # a stopped process dies with its host all the same
    one.sh("head -c 8M /dev/zero > /dev/shm/pool")
    assert sleeper.pid in one.pids() and server.pid in one.pids()
    start = time.monotonic()
    one.kill()
    assert time.monotonic() - start < 5
    assert server.poll() == -signal.SIGKILL and sleeper.poll() == -signal.SIGKILL
    assert frozen.poll() == -signal.SIGKILL
    assert one.pids() == []  # nothing holds its PID, network or mount namespace
    assert other.poll() is None and other.pid in two.pids()
    status, _ = fetch(two, "http://node1:8000/", timeout=3)
    assert status != "200"
    # A replacement has an empty /dev/shm: the dead host's pool went with it.
    three = cluster.add_host("node3")
    assert three.sh("ls -A /dev/shm") == ""
    assert three.address == "198.18.0.3"


def test_a_cut_link_times_out_without_a_reset_and_mends(cluster: Cluster) -> None:
    one, two = cluster.add_host("node1"), cluster.add_host("node2")
    serve_http(one)
    assert fetch(two, "http://node1:8000/")[0] == "200"
    two.cut_link()
    status, took = fetch(two, "http://node1:8000/", timeout=2)
    assert status == "curl exit 28" and took >= 1.9  # a timeout: nothing came back
    two.mend_link()
    status, _ = fetch(two, "http://node1:8000/", timeout=10)
    assert status == "200"


def test_a_slow_link_delays_every_frame_both_ways(cluster: Cluster) -> None:
    one, two = cluster.add_host("node1"), cluster.add_host("node2")
    serve_http(one)

    def connect_time() -> float:
        start = time.monotonic()
        socket.create_connection((one.address, 8000), 10).close()
        return time.monotonic() - start

    before = min(two.call(connect_time) for _ in range(3))
    two.slow_link(0)  # the wire is in, with no delay yet
    wired = min(two.call(connect_time) for _ in range(3))
    two.slow_link(0.15)  # now slow, at once
    slowed = min(two.call(connect_time) for _ in range(3))
    two.stop_slow()
    after = min(two.call(connect_time) for _ in range(3))
    # A connect is one round trip: SYN out, SYN-ACK back, 0.15 s each way.
    assert 0.3 <= slowed < 0.3 + 0.5, (before, wired, slowed, after)
    assert max(before, wired, after) < 0.1, (before, wired, slowed, after)


def test_two_runs_use_the_same_addresses_without_meeting(cluster: Cluster,
                                                         tmp_path: Path) -> None:
    with Cluster(tmp_path / "other", cwd=ROOT) as other:
        mine, theirs = cluster.add_host("node1"), other.add_host("node1")
        assert mine.address == theirs.address
        serve_http(mine)
        serve_http(theirs, port=8001)
        assert fetch(mine, "http://node1:8001/", timeout=2)[0] != "200"
        assert fetch(theirs, "http://node1:8000/", timeout=2)[0] != "200"
    assert theirs.pids() == []


def test_hosts_die_with_a_run_that_is_killed(tmp_path: Path) -> None:
    """A test process SIGKILLed (no finalizer, no atexit) leaves no host behind."""
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from tests.multinode.hosts import Cluster\n"
        "c = Cluster(Path(sys.argv[1]))\n"
        "h = c.add_host('node1')\n"
        "h.run(['sleep', '600'])\n"
        "print(c.switch.init, h.ns.init, h.processes[0].pid, flush=True)\n"
        "time.sleep(600)\n")
    tmp_path.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3, pids
    for pid in pids:
        os.kill(pid, 0)  # alive
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if Path(f"/proc/{p}").exists()]
    for pid in left[:2]:  # the inits: whatever is inside their PID namespaces dies too
        os.kill(pid, signal.SIGKILL)
    assert not left
