"""How long the server's document requests wait while it ingests chunks.

    python -m bench.control_latency                 # 512 MiB ingested 4 times per round
    python -m bench.control_latency --size 1G --rounds 3

A real ``ckptd serve`` over a local directory store. A prober asks for a job's
steps (``GET /v1/jobs/{job}/steps``: a listing of the store, what a commit's and a
restore plan's reads go through too) every 50 ms, first with the server idle, then
while 8 keep-alive connections upload 4 MiB chunks as fast as it takes them
(bench.dataplane's lean client). It prints each phase's median, 90th percentile and
worst latency, and the ratio of the busy median to the idle one measured in the
same round: on 2 cores the busy figures include the CPU the upload takes from the
prober and the server alike, so the ratio is what to compare between trees.
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import GiB, Server, parse_size
from bench.dataplane import CONNECTIONS, Chunks, Connection, spread

PROBE_EVERY_S = 0.05


def probe(port: int, stop: threading.Event, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/v1/jobs/probe/steps")
            conn.getresponse().read()
            out.append((time.perf_counter() - t0) * 1000)
            stop.wait(PROBE_EVERY_S)
    finally:
        conn.close()


def phase(server: Server, chunks: Chunks | None, uploads: int, idle_s: float,
          generation: int) -> list[float]:
    """Probe latencies (ms) while the server is idle for ``idle_s`` (``chunks`` None)
    or while it ingests ``chunks`` ``uploads`` times, each time new to the store."""
    out: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(server.port, stop, out))
    prober.start()
    try:
        if chunks is None:
            time.sleep(idle_s)
        for k in range(uploads if chunks is not None else 0):
            assert chunks is not None
            shutil.rmtree(server.store / "chunks", ignore_errors=True)
            chunks.renew(generation * 1000 + k)
            conns = [Connection(server.port) for _ in range(CONNECTIONS)]
            try:
                spread(conns, list(zip(chunks.ids, chunks.data, strict=True)),
                       lambda conn, job: conn.put(*job))
            finally:
                for conn in conns:
                    conn.close()
    finally:
        stop.set()
        prober.join()
    return sorted(out)


def summary(ms: list[float]) -> str:
    return (f"n={len(ms):4d}  median {statistics.median(ms):6.1f} ms  "
            f"p90 {ms[int(len(ms) * 0.9)]:6.1f} ms  worst {ms[-1]:6.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="512M", help="bytes per upload (default 512M)")
    parser.add_argument("--uploads", type=int, default=4, help="uploads per busy phase")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    chunks = Chunks(nbytes)
    scratch = Path(tempfile.mkdtemp(prefix="ckptd-control-"))
    try:
        with Server(scratch / "store", scratch / "server.log") as server:
            print(f"a listing every {PROBE_EVERY_S * 1000:.0f} ms; busy: {args.uploads} x "
                  f"{nbytes / GiB:.2f} GiB of 4 MiB chunks over {CONNECTIONS} connections")
            for r in range(1, args.rounds + 1):
                idle = phase(server, None, 0, 3.0, r)
                busy = phase(server, chunks, args.uploads, 0.0, r)
                ratio = statistics.median(busy) / statistics.median(idle)
                print(f"round {r}  idle: {summary(idle)}")
                print(f"round {r}  busy: {summary(busy)}   busy / idle median {ratio:.1f}x",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
