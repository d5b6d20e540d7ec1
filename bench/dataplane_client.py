"""Data plane, the client's side: CPU seconds per GiB of each path a rank's restore
bytes cross, beside the floor for the same bytes measured in the same run.

    python -m bench.dataplane_client                  # 512 MiB, 3 rounds
    python -m bench.dataplane_client --size 1G --rounds 5

``client_rows(size_bytes)`` gives the rows to ``bench/dataplane.py`` (which adds
the server's): each a dict with ``path``, ``cpu_s_per_gib``,
``floor_cpu_s_per_gib``, ``gbps``, ``target`` and ``note``.

The paths:

- **receiving the store tier over HTTP**: a rank restores its state with only the
  store tier from a ``ckptd serve`` process over a local directory store (atomic, the
  default, and ``atomic=False``); its own process's CPU (psutil: user + system, all
  threads) per GiB restored;
- **receiving from peers**: the same from two data-parallel peers' staging pools
  over loopback HTTP;
- **the peer server sending**: the CPU of those two peer processes per GiB they
  served;
- **reading the object store directly** (presigned URLs, when moto is installed):
  the same restore over a server whose store is moto's S3, the rank reading every
  chunk from moto itself.

The floor of a receive is what the bytes cannot avoid: blake3 of them once (one
thread) plus one copy of them into memory already touched (``np.copyto``), timed
on one thread (``time.thread_time``) right before each round. The floor of a send
is a plain ``sendall`` of the same bytes over loopback TCP to a reader that
discards them, the sending thread's CPU (the kernel's copy, and both ends' TCP
work, which loopback charges to the sender). The targets (issue 21): receive <=
2x its floor, egress <= 1.5x.

CPU time, not wall time, is the figure: it holds on a loaded machine (2 cores
shared with other work here), and it says how many cores a GB/s costs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import psutil
import torch

from bench.common import (
    GiB,
    Server,
    Table,
    fmt_x,
    free_port,
    human_bytes,
    machine,
    make_state,
    parse_size,
    quiesce,
    release_free_memory,
    scratch_dir,
    state_nbytes,
    tensors_of,
)

JOB = "bench-dataplane"
STEP = 1
WORLD = 3  # rank 0 restores; ranks 1 and 2 are the peers
CHUNK = 4 << 20
RECEIVE_TARGET = 2.0
SEND_TARGET = 1.5


def cpu_seconds(proc: psutil.Process) -> float:
    """A process's CPU time so far (user + system, every thread)."""
    t = proc.cpu_times()
    return float(t.user + t.system)


def zeros_like(state: Any) -> Any:
    """A target shaped like ``state``, every page touched (a constructed model)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return state


def byte_arrays(state: Any) -> list[np.ndarray[Any, Any]]:
    return [t.reshape(-1).view(torch.uint8).numpy() for t in tensors_of(state)]


class Floor:
    """The floors of the state's bytes, on one thread: blake3 once, and a copy into
    memory already touched."""

    def __init__(self, state: Any) -> None:
        self.src = byte_arrays(state)
        self.dst = [np.empty_like(a) for a in self.src]
        for d, s in zip(self.dst, self.src, strict=True):
            np.copyto(d, s)  # touched
        self.nbytes = sum(a.nbytes for a in self.src)

    def copy(self) -> float:
        t0 = time.thread_time()
        for d, s in zip(self.dst, self.src, strict=True):
            np.copyto(d, s)
        return time.thread_time() - t0

    def send(self) -> float:
        """One thread's CPU to send the bytes over loopback TCP (4 MiB sends) to a
        reader that discards them: the floor of a sending peer (the kernel's copy and
        both ends' TCP work, which loopback charges to the sender)."""
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]

        def sink() -> None:
            conn, _ = srv.accept()
            buf = memoryview(bytearray(CHUNK))
            with conn:
                while conn.recv_into(buf, CHUNK, socket.MSG_WAITALL):
                    pass

        reader = threading.Thread(target=sink, daemon=True)
        reader.start()
        with socket.create_connection(("127.0.0.1", port)) as out:
            out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.thread_time()
            for a in self.src:
                view = memoryview(a.data)
                for k in range(0, a.nbytes, CHUNK):
                    out.sendall(view[k : k + CHUNK])
            seconds = time.thread_time() - t0
        reader.join(30)
        srv.close()
        return seconds

    def hash(self) -> float:
        t0 = time.thread_time()
        for a in self.src:
            for k in range(0, a.nbytes, CHUNK):  # chunk by chunk, as a restore hashes
                blake3.blake3(a[k : k + CHUNK].data).digest()
        return time.thread_time() - t0


def peer_main(url: str, rank: int, size: int) -> None:
    """A peer rank: saves the state, drops its own copy, serves its pool."""
    from ckptd.client import Checkpointer

    state = make_state(size)
    ckpt = Checkpointer(url, JOB, rank=rank, world_size=WORLD, chunk_size=CHUNK,
                        heartbeat_interval=0.5)
    ckpt.save(STEP, state).wait(timeout=600)
    del state
    release_free_memory()
    print("READY", flush=True)
    while True:
        time.sleep(3600)


def wait_peers(url: str, ranks: list[int], timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = httpx.get(f"{url}/v1/jobs/{JOB}/ranks", timeout=10)
        if resp.status_code == 200:
            held = {r["rank"]: r["held_step"] for r in resp.json()["ranks"]}
            if all(held.get(r) == STEP for r in ranks):
                return
        time.sleep(0.2)
    raise RuntimeError(f"peers {ranks} never held step {STEP}")


class Measured:
    """Per path: CPU-s per GiB of each round, its paired floor, and GB/s."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}
        self.floor: dict[str, list[float]] = {}
        self.gbps: dict[str, list[float]] = {}

    def add(self, path: str, cpu: float, floor: float, gbps: float) -> None:
        self.cpu.setdefault(path, []).append(cpu)
        self.floor.setdefault(path, []).append(floor)
        self.gbps.setdefault(path, []).append(gbps)

    def row(self, path: str, target: float, note: str) -> dict[str, Any]:
        cpu = statistics.median(self.cpu[path])
        floor = statistics.median(self.floor[path])
        ratios = [c / f for c, f in zip(self.cpu[path], self.floor[path], strict=True) if f]
        return {
            "path": path,
            "cpu_s_per_gib": cpu,
            "floor_cpu_s_per_gib": floor,
            "gbps": statistics.median(self.gbps[path]),
            "target": f"<= {target:g}x floor",
            "note": note,
            "ratio": statistics.median(ratios) if ratios else float("nan"),
            "rounds": len(self.cpu[path]),
        }


@contextlib.contextmanager
def peer_processes(url: str, size: int) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [subprocess.Popen([sys.executable, "-m", "bench.dataplane_client", "--peer", url,
                               str(r), str(size)], stdout=subprocess.PIPE, text=True)
             for r in (1, 2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
        # Killed peers leave their pools in /dev/shm, as a crash would.
        from ckptd.client.staging.reader import remove_stale_pools

        remove_stale_pools(job=JOB)


def moto_main(port: int, bucket: str) -> None:
    """moto's S3 server on 127.0.0.1:``port`` with one bucket; prints its URL."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer("127.0.0.1", port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    print(url, flush=True)
    threading.Event().wait()


def have_s3() -> bool:
    try:
        import aiobotocore  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def s3_server(scratch: Path) -> Iterator[str]:
    """A ``ckptd serve`` over moto's S3 (its own process): yields the server's URL."""
    import httpx

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    procs: list[subprocess.Popen[str]] = []
    try:
        moto = subprocess.Popen([sys.executable, "-m", "bench.dataplane_client", "--moto",
                                 str(free_port()), "bench"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        procs.append(moto)
        assert moto.stdout is not None
        endpoint = moto.stdout.readline().strip()
        port = free_port()
        with open(scratch / "s3-server.log", "ab") as log:
            procs.append(subprocess.Popen(  # type: ignore[arg-type]
                [sys.executable, "-m", "ckptd", "serve", "--store",
                 f"s3://bench/dataplane?endpoint={endpoint}", "--host", "127.0.0.1", "--port",
                 str(port), "--no-access-log"], env=env, stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("ckptd serve over moto did not start")
            time.sleep(0.2)
        yield url
    finally:
        for p in procs:
            p.kill()
            p.wait()


PATHS = {
    "store": "client receiving the store tier (HTTP)",
    "store in-place": "client receiving the store tier (HTTP), atomic=False",
    "peer": "client receiving from 2 peers (loopback HTTP)",
    "peer in-place": "client receiving from 2 peers, atomic=False",
    "peer send": "peer server sending (2 peers, per GiB sent)",
    "object": "client reading the object store directly (presigned, moto)",
}


def client_rows(size_bytes: int, rounds: int = 3, parent: str | None = None,
                object_store: bool = True) -> list[dict[str, Any]]:
    """The client's data-plane rows for a state of ``size_bytes`` (see the module);
    ``object_store``: with the presigned row (when moto and aiobotocore are here)."""
    from ckptd.client import Checkpointer

    measured = Measured()
    me = psutil.Process()
    with scratch_dir(parent, "ckptd-dataplane-") as scratch:
        os.environ.setdefault("CKPTD_HEARTBEAT_INTERVAL", "0.5")
        with Server(scratch / "store", scratch / "server.log") as server, \
                peer_processes(server.url, size_bytes) as peers:
            state = make_state(size_bytes)
            nbytes = state_nbytes(state)
            gib = nbytes / GiB
            with Checkpointer(server.url, JOB, rank=0, world_size=WORLD, chunk_size=CHUNK,
                              serve_peers=False) as owner:
                owner.save(STEP, state).wait(timeout=600)
            for p in peers:
                assert p.stdout is not None
                if not p.stdout.readline().startswith("READY"):
                    raise RuntimeError("a peer process failed to start")
            wait_peers(server.url, [1, 2])
            floor = Floor(state)
            target = zeros_like(state)
            peer_procs = [psutil.Process(p.pid) for p in peers]

            def restore(tier: str, atomic: bool) -> tuple[float, float, float]:
                """(client CPU-s, peers' CPU-s, seconds) of one restore."""
                with Checkpointer(server.url, JOB, rank=0, world_size=WORLD,
                                  serve_peers=False) as ckpt:
                    c0, p0 = cpu_seconds(me), sum(cpu_seconds(p) for p in peer_procs)
                    t0 = time.perf_counter()
                    result = ckpt.restore(target, tiers=(tier,), atomic=atomic)
                    seconds = time.perf_counter() - t0
                    c1, p1 = cpu_seconds(me), sum(cpu_seconds(p) for p in peer_procs)
                assert result.bytes_from.get(tier, 0) == result.bytes_fetched == nbytes, result
                check_and_clear(target, state)
                return c1 - c0, p1 - p0, seconds

            systems = [("store", True), ("store", False), ("peer", True), ("peer", False)]
            s3 = contextlib.ExitStack()
            s3_url = (s3.enter_context(s3_server(scratch)) if object_store and have_s3()
                      else None)
            if s3_url is not None:
                with Checkpointer(s3_url, JOB, chunk_size=CHUNK, serve_peers=False) as owner:
                    owner.save(STEP, state).wait(timeout=1200)
                systems.append(("object", True))

            def direct() -> tuple[float, float, float]:
                """(client CPU-s, 0, seconds) of a restore whose chunks come from moto."""
                assert s3_url is not None
                with Checkpointer(s3_url, JOB, serve_peers=False) as ckpt:
                    c0, t0 = cpu_seconds(me), time.perf_counter()
                    result = ckpt.restore(target, tiers=("store",))
                    seconds, c1 = time.perf_counter() - t0, cpu_seconds(me)
                assert result.bytes_from.get("object", 0) == nbytes, result
                check_and_clear(target, state)
                return c1 - c0, 0.0, seconds

            for rnd in range(rounds):
                for tier, atomic in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
                    quiesce()
                    release_free_memory()
                    receive_floor = (floor.hash() + floor.copy()) / gib
                    send_floor = floor.send() / gib
                    client, sent, seconds = (direct() if tier == "object"
                                             else restore(tier, atomic))
                    name = tier if atomic else f"{tier} in-place"
                    measured.add(name, client / gib, receive_floor, nbytes / seconds / 1e9)
                    if tier == "peer":
                        measured.add("peer send", sent / gib, send_floor,
                                     nbytes / seconds / 1e9)
                print(f"round {rnd + 1}/{rounds}: " + ", ".join(
                    f"{k} {v[-1]:.3f} CPU-s/GiB (floor {measured.floor[k][-1]:.3f})"
                    for k, v in measured.cpu.items()), file=sys.stderr, flush=True)
            s3.close()
    rows = [
        measured.row("store", RECEIVE_TARGET,
                     "atomic: chunks land in fresh memory, then are copied into the target"),
        measured.row("store in-place", RECEIVE_TARGET,
                     "each chunk received into the target's own tensor and hashed there"),
        measured.row("peer", RECEIVE_TARGET, "atomic, as the store row"),
        measured.row("peer in-place", RECEIVE_TARGET, "as the store row, atomic=False"),
        measured.row("peer send", SEND_TARGET,
                     "the two peer processes' CPU per GiB they sent (both restores); the "
                     "floor is a plain loopback send of the bytes (one thread's CPU)"),
    ]
    if "object" in measured.cpu:
        rows.append(measured.row(
            "object", RECEIVE_TARGET,
            "atomic, every chunk read by the rank from moto's S3 through the restore plan's "
            "presigned URLs (the server carries none); moto serves on the same cores and "
            "closes each connection after one answer (Connection: close), so every chunk "
            "pays a TCP connect and slow start here; S3 keeps connections alive"))
    for row in rows:
        row["path"] = PATHS[row["path"]]
    return rows


def check_and_clear(target: Any, state: Any) -> None:
    """The target holds the state bitwise; then zeroed for the next round."""
    for got, want in zip(tensors_of(target), tensors_of(state), strict=True):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    for t in tensors_of(target):
        t.view(torch.uint8).zero_() if t.dtype != torch.bool else t.zero_()


def table(rows: list[dict[str, Any]], size: int) -> Table:
    t = Table(f"Data plane, the client's side ({human_bytes(size)} state, median of "
              f"{rows[0]['rounds'] if rows else 0} rounds)",
              ["path", "CPU-s / GiB", "floor CPU-s / GiB", "ratio", "GB/s", "target", "met"])
    for r in rows:
        x = r["cpu_s_per_gib"] / r["floor_cpu_s_per_gib"] if r["floor_cpu_s_per_gib"] else None
        most = float(r["target"].split()[1].rstrip("x"))
        t.add(r["path"], f"{r['cpu_s_per_gib']:.3f}", f"{r['floor_cpu_s_per_gib']:.3f}",
              fmt_x(x), f"{r['gbps']:.2f}", r["target"],
              "yes" if x is not None and x <= most else "NO")
    t.note("CPU: the process's user + system seconds (psutil, every thread) per GiB. Floor "
           "of a receive: blake3 once (one thread) + one copy into touched memory, timed "
           "before each round; of a send: a plain loopback TCP send of the same bytes. "
           "ratio: the median of each round's CPU over its own floor.")
    for r in rows:
        t.note(f"{r['path']}: {r['note']}")
    return t


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        peer_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--moto":
        moto_main(int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="512M", help="state size (default 512M)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="parent of the scratch directory")
    parser.add_argument("--markdown", default=None, help="write the table to this file")
    parser.add_argument("--no-object", action="store_true",
                        help="leave out the object-store row (moto)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gc.collect()
    size = parse_size(args.size)
    info = machine(Path(args.scratch or "/tmp"))
    rows = client_rows(size, args.rounds, args.scratch, not args.no_object)
    out = table(rows, size)
    out.print()
    if args.markdown:
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info]
        Path(args.markdown).write_text(out.markdown() + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
