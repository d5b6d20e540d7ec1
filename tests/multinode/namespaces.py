"""The namespaces a simulated host lives in (see hosts.py): an init process that
holds fresh PID, network, mount and UTS namespaces and dies with whoever started
it, ``nsenter`` command lines into them, ``ip`` in them, and calls made from a
thread of this process that entered one of their networks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CLONE_NEWNET = 0x40000000
TOOLS = ("unshare", "nsenter", "setpriv", "ip")
T = TypeVar("T")

# The init of a host (PID 1 of its namespace): sets the host up, says "ready" and
# then reaps the orphans that land on it until it is killed.
_INIT = r"""
import os, socket, subprocess, sys, time
name, shm_size, hosts = sys.argv[1:4]
socket.sethostname(name)
if shm_size:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777,nosuid,nodev",
                    sys.argv[4], "/dev/shm"], check=True)
if hosts:
    subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], check=True)
    # No DNS server is reachable from a host: a resolver with none fails at once
    # (127.0.0.1:53 refuses) where the machine's would time out on each lookup.
    subprocess.run(["mount", "--bind", sys.argv[5], "/etc/resolv.conf"], check=True)
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
print("ready", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""


class HostError(RuntimeError):
    """A simulated host or link could not be set up, or did not do what it was told."""


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot run here (one line), or None when they can."""
    if sys.platform != "linux":
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network, mount and PID namespaces; CI runs as root)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--pid", "--fork", "true"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        return (f"simulated hosts cannot create namespaces here: "
                f"{probe.stderr.decode(errors='replace').strip()[:200]}")
    return None


def deadline_loop(timeout: float, what: str, check: Callable[[], T | None],
                   interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise HostError(f"{what} within {timeout:g} s")
        time.sleep(interval)


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


class Namespaces:
    """An init process holding fresh namespaces; dies with whoever started it."""

    def __init__(self, name: str, log: Path, cwd: Path, shm_size: str = "",
                 hosts: Path | None = None, tag: str = "") -> None:
        self.name = name
        self.log_path = log
        resolv = log.with_name("resolv.conf")
        resolv.write_text("# no name server: names are in /etc/hosts\n")
        with open(log, "ab") as out:
            self.holder = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--",
                 "unshare", "--net", "--uts", "--pid", "--fork", "--kill-child",
                 "--mount-proc", "--propagation", "private",
                 sys.executable, "-S", "-c", _INIT, name, shm_size,
                 str(hosts) if hosts else "", tag or f"shm-{name}", str(resolv)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                start_new_session=True)
        try:
            self.init = deadline_loop(10, f"{name}: no init process appeared",
                                       lambda: next(iter(children(self.holder.pid)), None))
            deadline_loop(30, f"{name}: init did not say ready ({self.log()[-500:]})",
                           lambda: True if "ready" in self.log() or self._failed() else None)
            if self._failed():
                raise HostError(f"{name}: init failed: {self.log()[-2000:]}")
        except BaseException:
            self.kill()
            raise
        self.inodes = {k: ns_inode(self.init, k) for k in ("net", "mnt", "pid", "uts")}

    def _failed(self) -> bool:
        return self.holder.poll() is not None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.holder.poll() is None

    def kill(self) -> None:
        """SIGKILLs the init: the kernel kills everything in its PID namespace."""
        init = getattr(self, "init", None)
        if init is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)
        if self.holder.poll() is None:
            try:
                self.holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait(timeout=10)

    def holders(self) -> list[int]:
        """Every process (root-namespace pid) still in one of these namespaces."""
        wanted = {(k, v) for k, v in getattr(self, "inodes", {}).items() if v is not None}
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                pid = int(entry)
                if any(ns_inode(pid, k) == v for k, v in wanted):
                    found.append(pid)
        return found

    def nsenter(self, *parts: str, pid: bool = True, mount: bool = True,
                wd: Path | None = None) -> list[str]:
        flags = [f"--target={self.init}", "--net", "--uts"]
        if wd is not None:
            flags.append(f"--wd={wd}")
        if mount:
            flags.append("--mount")
        if pid:
            flags.append("--pid")
        return ["nsenter", *flags, "--", *parts]

    def ip(self, *args: str) -> str:
        """``ip ARGS`` in this network namespace (the root /proc, so ``netns PID`` works)."""
        done = subprocess.run(self.nsenter("ip", *args, pid=False, mount=False),
                              capture_output=True, timeout=30)
        if done.returncode != 0:
            raise HostError(f"{self.name}: ip {' '.join(args)}: "
                            f"{done.stderr.decode(errors='replace').strip()}")
        return done.stdout.decode()

    def call(self, fn: Callable[..., T], *args: object, timeout: float = 60.0) -> T:
        """``fn(*args)`` on a thread of this process that entered this network
        namespace (only that thread: the rest of the process stays where it is)."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/proc/{self.init}/ns/net", os.O_RDONLY)
                try:
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.name}")
                finally:
                    os.close(fd)
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"in-{self.name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise HostError(f"{self.name}: call {getattr(fn, '__name__', fn)} ran past {timeout} s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]
