"""A link that delays every frame by a fixed time, both ways: two tap devices and
this process between them (run inside the switch's namespace by hosts.py).

It stands in for ``tc qdisc add ... netem delay``: the kernels this project's
machines and CI run have no sch_netem (``tc`` says "Specified qdisc kind is
unknown"), and tbf or htb only shape bandwidth. A constant delay keeps frames in
order, so each direction is a FIFO of (due time, frame).

argv: NEAR FAR CONTROL. The file CONTROL holds "N DELAY_S" and is read again
whenever it changes ("applied N" is printed once that delay is in force): a link
turns slow while traffic flows, without a pause. Prints "ready" once both taps
exist; runs until killed."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import struct
import sys
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
FRAME = 65536


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main() -> None:
    near_name, far_name, control = sys.argv[1:4]
    delay, seen, looked = 0.0, -1, 0.0
    near, far = open_tap(near_name), open_tap(far_name)
    other = {near: far, far: near}
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        near: collections.deque(), far: collections.deque()}  # frames to write to the key
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        if now - looked > 0.05:
            looked = now
            mtime = os.stat(control).st_mtime_ns
            if mtime != seen:
                order, value = Path(control).read_text().split()
                seen, delay = mtime, float(value)
                print(f"applied {order}", flush=True)  # what slow_link() waits for
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else 0.05
        readable, _, _ = select.select([near, far], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            for _ in range(256):
                try:
                    frame = os.read(fd, FRAME)
                except BlockingIOError:
                    break
                except OSError:  # the tap's other side went down: drop, as a wire would
                    break
                queues[other[fd]].append((now + delay, frame))
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                with contextlib.suppress(OSError):  # a tap down, a full queue: lost
                    os.write(fd, frame)


if __name__ == "__main__":
    main()
