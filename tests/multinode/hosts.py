"""Simulated hosts on one machine: each host is a PID, network, mount and UTS
namespace held by a small init process, with its own hostname, ``/etc/hosts``,
a private tmpfs on ``/dev/shm`` and one link (a veth pair) to a switch. The
switch is a bridge inside a namespace of its own, so nothing is ever created in
the root namespace and two runs on one machine never meet (both may use the same
addresses: each has its own switch).

Addresses are in 198.18.0.0/24 (RFC 2544's benchmarking range). Killing a host
SIGKILLs its init; the kernel then kills every process in its PID namespace, the
network namespace goes with them (and the veth with it) and so does the mount
namespace, its ``/dev/shm`` included: the host is gone as a powered-off machine
is. Every process this module starts outside a host dies with the process that
started it (``PR_SET_PDEATHSIG`` on the namespace holders, which pass SIGKILL on
to their init), so even a SIGKILLed test run leaves nothing behind.

Needs root, util-linux (``unshare``, ``nsenter``, ``setpriv``) and iproute2."""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from tests.multinode.namespaces import (
    HostError,
    Namespaces,
    children,
    deadline_loop,
    unavailable_reason,
)

__all__ = ["SUBNET", "Cluster", "Host", "HostError", "HostProcess", "unavailable_reason"]

SUBNET = "198.18.0"  # /24; .1 upwards are hosts
T = TypeVar("T")


class HostProcess:
    """A process started on a host: ``nsenter`` (its parent, outside) and the
    process itself (inside the host's PID namespace), tracked by pid."""

    def __init__(self, host: Host, popen: subprocess.Popen[bytes], log: Path,
                 argv: Sequence[str]) -> None:
        self.host = host
        self.popen = popen
        self.log_path = log
        self.argv = list(argv)

    @property
    def pid(self) -> int:
        """The process's pid as this (root) namespace sees it."""
        return deadline_loop(5, f"{self.host.name}: {self.argv[0]} never started",
                              lambda: next(iter(children(self.popen.pid)), None)
                              if self.popen.poll() is None else -1)

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the process itself (nsenter passes on how it ended)."""
        pid = self.pid
        if pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig not in (signal.SIGSTOP, signal.SIGTSTP):
            self.wake_nsenter()

    def wake_nsenter(self) -> None:
        """nsenter stops itself when its child stops (job control); a stopped
        nsenter never reaps its child, and a PID namespace holding an unreaped
        child of an outside parent cannot end. So it is woken after any other signal."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGCONT)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise HostError(f"{self.host.name}: {' '.join(self.argv[:4])} ran past {timeout:g} s;"
                            f" its log ends:\n{self.log()[-4000:]}") from None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
        return self.popen.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Host:
    """One simulated machine on the cluster's switch."""

    def __init__(self, cluster: Cluster, name: str, index: int, shm_size: str) -> None:
        self.cluster = cluster
        self.name = name
        self.index = index
        self.address = f"{SUBNET}.{index}"
        self.port = f"p{index}"  # its port on the switch
        self.dir = cluster.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "tmp").mkdir(exist_ok=True)
        self.hosts_file = self.dir / "hosts"
        cluster.write_hosts_file(self.hosts_file, extra=(self.address, name))
        self.processes: list[HostProcess] = []
        self.ns = Namespaces(name, self.dir / "init.log", cluster.dir, shm_size=shm_size,
                              hosts=self.hosts_file, tag=f"ckptd-{cluster.run_id}-{name}")
        self.dead = False
        self._slow: subprocess.Popen[bytes] | None = None
        self._delays = 0

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
            log: str | None = None, cwd: Path | None = None) -> HostProcess:
        """Starts ``argv`` on this host, its output to ``<host dir>/<log>``."""
        if self.dead:
            raise HostError(f"{self.name} is dead")
        name = log or f"{Path(argv[0]).name}-{len(self.processes)}.log"
        path = self.dir / name
        full = dict(env if env is not None else os.environ)
        full.setdefault("TMPDIR", str(self.dir / "tmp"))  # no /tmp shared between hosts
        with open(path, "ab") as out:
            popen = subprocess.Popen(
                self.ns.nsenter(*argv, wd=cwd or self.cluster.cwd),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=full,
                start_new_session=True)
        proc = HostProcess(self, popen, path, argv)
        self.processes.append(proc)
        return proc

    def sh(self, command: str, timeout: float = 30.0) -> str:
        """A shell command on this host; its output (raises if it fails)."""
        done = subprocess.run(self.ns.nsenter("sh", "-c", command), capture_output=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise HostError(f"{self.name}: {command}: exit {done.returncode}: "
                            f"{(done.stdout + done.stderr).decode(errors='replace')[-2000:]}")
        return done.stdout.decode(errors="replace")

    def call(self, fn: Callable[..., T], *args: object, timeout: float = 60.0) -> T:
        """``fn(*args)`` from inside this host's network (see ``Namespaces.call``)."""
        return self.ns.call(fn, *args, timeout=timeout)

    def pids(self) -> list[int]:
        """Every process on this host (root-namespace pids), its init included."""
        return self.ns.holders()

    def kill(self) -> None:
        """Powers the host off: SIGKILL to everything on it; its network and its
        /dev/shm go with it. Waits (bounded) until no process is left in it."""
        self.stop_slow()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.ns.init, signal.SIGKILL)
        for proc in self.processes:  # so that they reap what the kernel just killed
            proc.wake_nsenter()
        self.ns.kill()
        self.dead = True
        for proc in self.processes:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
        deadline_loop(10, f"{self.name}: processes left after the kill: {self.pids()}",
                       lambda: True if not self.pids() else None)

    # The link: the switch holds the other end of the host's eth0.
    def cut_link(self) -> None:
        """The cable is pulled: the switch's port goes down, nothing passes, no
        reset reaches either side; the host and its processes live on."""
        self.cluster.switch.ip("link", "set", self.port, "down")

    def mend_link(self) -> None:
        """The cable is back. Returns once the link carries traffic: the carrier is
        up and no address resolution begun while it was cut is still pending. Such
        a lookup runs out its probes after the mend (about a second) and fails the
        connections queued on it with "no route to host" (kernel 6.18 keeps the
        entry across the carrier change); a real host meets that once, here it
        would be a race in every test that mends a link."""
        self.cluster.switch.ip("link", "set", self.port, "up")
        deadline_loop(15, f"{self.name}: the mended link did not come up",
                      lambda: None if "LOWER_UP" not in self.sh("ip -o link show eth0")
                      or " INCOMPLETE" in self.sh("ip neigh show dev eth0") else True)

    def slow_link(self, delay_s: float) -> None:
        """Every frame to and from this host waits ``delay_s`` on the wire (see
        wire.py). The first call puts the wire in (a ``slow_link(0)`` beforehand
        makes a later slowdown instantaneous, with no pause in the traffic)."""
        control = self.dir / "wire-delay"
        self._delays += 1
        tmp = control.with_suffix(".tmp")
        tmp.write_text(f"{self._delays} {float(delay_s)!r}")
        os.replace(tmp, control)
        if self._slow is None:
            self._slow = self.cluster.delay_port(self, control)
        log = self.dir / "wire.log"
        deadline_loop(10, f"{self.name}: the wire did not take delay {delay_s}",
                       lambda: True if f"applied {self._delays}\n" in log.read_text() else None)

    def stop_slow(self) -> None:
        if self._slow is not None:
            self.cluster.undelay_port(self, self._slow)
            self._slow = None


class Cluster:
    """A switch and the hosts on it; ``close()`` (also run at exit) tears all down."""

    def __init__(self, workdir: Path, *, cwd: Path | None = None,
                 run_id: str | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise HostError(reason)
        self.run_id = run_id or secrets.token_hex(4)
        self.dir = Path(workdir) / f"hosts-{self.run_id}"
        self.dir.mkdir(parents=True)
        self.cwd = cwd or Path.cwd()
        self.hosts: dict[str, Host] = {}
        self._next = 1
        self._names: list[tuple[str, str]] = []
        self._closed = False
        self.switch = Namespaces("switch", self.dir / "switch.log", self.dir)
        _live.add(self)
        try:
            self.switch.ip("link", "add", "br0", "type", "bridge")
            self.switch.ip("link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_hosts_file(self, path: Path, extra: tuple[str, str] | None = None) -> None:
        lines = ["127.0.0.1\tlocalhost", *(f"{a}\t{n}" for a, n in self._names)]
        if extra is not None and extra not in self._names:
            lines.append(f"{extra[0]}\t{extra[1]}")
        # Rewritten in place: a host's /etc/hosts is a bind mount of this inode.
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    def add_host(self, name: str, *, shm_size: str = "512m") -> Host:
        """A new host on the switch, at the next free address."""
        if name in self.hosts and not self.hosts[name].dead:
            raise HostError(f"host {name} exists")
        if self._next > 250:
            raise HostError("no addresses left in 198.18.0.0/24")
        index, self._next = self._next, self._next + 1
        self._names.append((f"{SUBNET}.{index}", name))
        for other in self.hosts.values():
            self.write_hosts_file(other.hosts_file)
        host = Host(self, name, index, shm_size)
        self.hosts[name] = host
        try:
            self.switch.ip("link", "add", host.port, "type", "veth", "peer", "name", "eth0",
                           "netns", str(host.ns.init))
            self.switch.ip("link", "set", host.port, "master", "br0", "up")
            host.ns.ip("addr", "add", f"{host.address}/24", "dev", "eth0")
            host.ns.ip("link", "set", "eth0", "up")
        except BaseException:
            host.kill()
            raise
        return host

    def delay_port(self, host: Host, control: Path) -> subprocess.Popen[bytes]:
        """Puts a delaying wire between the host's port and the bridge: the port
        moves to a bridge of its own whose other member is one end of the wire."""
        near, far, lane = f"w{host.index}h", f"w{host.index}s", f"b{host.index}"
        log = host.dir / "wire.log"
        with open(log, "ab") as out:
            wire = subprocess.Popen(
                self.switch.nsenter(sys.executable, str(Path(__file__).with_name("wire.py")),
                                    near, far, str(control)),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline_loop(15, f"{host.name}: the delay wire did not start "
                           f"({log.read_text(errors='replace')[-500:]})",
                       lambda: True if "ready" in log.read_text() or wire.poll() is not None
                       else None)
        if wire.poll() is not None:
            raise HostError(f"{host.name}: the delay wire failed: {log.read_text()[-2000:]}")
        ip = self.switch.ip
        ip("link", "add", lane, "type", "bridge")
        ip("link", "set", lane, "up")
        ip("link", "set", near, "master", lane, "up")
        ip("link", "set", far, "master", "br0", "up")
        ip("link", "set", host.port, "nomaster")
        ip("link", "set", host.port, "master", lane)
        return wire

    def undelay_port(self, host: Host, wire: subprocess.Popen[bytes]) -> None:
        lane = f"b{host.index}"
        if self.switch.alive():
            try:
                self.switch.ip("link", "set", host.port, "nomaster")
                self.switch.ip("link", "set", host.port, "master", "br0")
            except HostError:
                pass  # the host is gone, and its port with it
        wire.kill()  # its tap devices go with it
        wire.wait(timeout=10)
        if self.switch.alive():
            with contextlib.suppress(HostError):
                self.switch.ip("link", "del", lane)

    def close(self) -> None:
        """Kills every host and the switch; waits until no process is left in any."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            if not host.dead:
                host.kill()
        self.switch.kill()
        deadline_loop(10, f"switch processes left: {self.switch.holders()}",
                       lambda: True if not self.switch.holders() else None)
        _live.discard(self)


_live: weakref.WeakSet[Cluster] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception as exc:  # noqa: BLE001 - at exit, say it and go on
            print(f"tearing down simulated hosts {cluster.run_id}: {exc}", file=sys.stderr)
