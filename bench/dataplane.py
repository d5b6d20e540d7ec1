"""The data plane in one table: CPU seconds per GiB of every path chunk bytes cross,
beside the floor for the same bytes measured in the same run.

    python -m bench.dataplane                        # 1 GiB, 3 rounds, every row
    python -m bench.dataplane --size 256M --rounds 2 --server-only
    python -m bench.dataplane --markdown out.md

The server's rows (this module), against a real ``ckptd serve`` over a local
directory store, its CPU read with psutil (user + system, every thread):

- **ingest** (rank -> server): 4 MiB chunks ``PUT /v1/chunks/{id}`` over 8
  keep-alive connections; the server parses, verifies (blake3) and stores each
  (temporary file, fsync, link). Floor: blake3 of the bytes once (one thread)
  plus writing them to the page cache, one file per chunk, timed on one thread
  (``time.thread_time``) right before each round. The server also fsyncs each
  chunk and its directory: the note gives what that costs on this disk's floor.
- **egress** (server -> rank, the store tier): the same chunks read back, 8 per
  ``POST /v1/chunks/read`` (what a restore asks) and one per ``GET``, page cache
  warm. Floor: reading each chunk file into a reused buffer plus sending it on a
  loopback TCP connection (the sending thread's CPU).

The sender and reader here are lean raw-socket HTTP/1.1 clients, so that the
client's CPU takes as little of the machine's cores as it can; only the server's
CPU counts. The client's rows (receiving the store tier, peers, the restore
ratios against torch.load and FileSystemReader) come from
``bench.dataplane_client.client_rows`` when that module is present.

CPU time, not wall time, is the figure: it holds on a loaded machine, and it says
how many cores a GB/s costs. Targets (issue 21): ingest <= 2x its floor, receive
<= 2x, egress <= 1.5x.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import queue
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import psutil

from bench.common import (
    GiB,
    MiB,
    Server,
    Table,
    fmt_x,
    machine,
    parse_size,
    quiesce,
    scratch_dir,
    size_label,
)

CHUNK = 4 * MiB
CONNECTIONS = 8
READ_BATCH = 8
INGEST_TARGET = 2.0
EGRESS_TARGET = 1.5


def cpu_seconds(proc: psutil.Process) -> float:
    """A process's CPU time so far (user + system, every thread)."""
    t = proc.cpu_times()
    return float(t.user + t.system)


# ---------------------------------------------------------------- the bytes


@dataclass
class Chunks:
    """Incompressible chunks and their ids; ``renew`` makes them new to a store."""

    nbytes: int
    seed: int = 0
    data: list[bytearray] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        for start in range(0, self.nbytes, CHUNK):
            self.data.append(bytearray(rng.bytes(min(CHUNK, self.nbytes - start))))
        self.ids = [blake3.blake3(d).hexdigest() for d in self.data]

    def renew(self, generation: int) -> None:
        for d in self.data:
            d[:8] = generation.to_bytes(8, "little")
        self.ids = [blake3.blake3(d).hexdigest() for d in self.data]


# ---------------------------------------------------------------- a lean HTTP client


class Connection:
    """One keep-alive HTTP/1.1 connection: requests out, answers read into a reused
    buffer."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()  # read past the last answer's end
        self.body = bytearray(CHUNK * READ_BATCH)

    def close(self) -> None:
        self.sock.close()

    def _head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self.pending:
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("the server closed the connection")
            self.pending += more
        end = self.pending.index(b"\r\n\r\n")
        lines = bytes(self.pending[:end]).decode("latin-1").split("\r\n")
        del self.pending[: end + 4]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(lines[0].split()[1]), headers

    def answer(self) -> tuple[int, dict[str, str], memoryview]:
        """The next answer: status, headers and body (a view valid until the next)."""
        status, headers = self._head()
        size = int(headers.get("content-length", "0"))
        if size > len(self.body):
            self.body = bytearray(size)
        view = memoryview(self.body)[:size]
        got = min(size, len(self.pending))
        view[:got] = self.pending[:got]
        del self.pending[:got]
        while got < size:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the server closed the connection mid-answer")
            got += n
        return status, headers, view

    def put(self, cid: str, data: bytearray) -> int:
        self.sock.sendall(f"PUT /v1/chunks/{cid} HTTP/1.1\r\nHost: bench\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode())
        self.sock.sendall(data)
        status, _, body = self.answer()
        if status not in (200, 201):
            raise RuntimeError(f"PUT answered {status}: {bytes(body[:300])!r}")
        return status

    def get(self, cid: str) -> int:
        self.sock.sendall(f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        status, _, body = self.answer()
        if status != 200:
            raise RuntimeError(f"GET answered {status}: {bytes(body[:300])!r}")
        return len(body)

    def read(self, ids: Sequence[str]) -> int:
        payload = ('{"ids":[' + ",".join(f'"{c}"' for c in ids) + "]}").encode()
        self.sock.sendall(b"POST /v1/chunks/read HTTP/1.1\r\nHost: bench\r\n"
                          b"Content-Type: application/json\r\n"
                          + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status, headers, body = self.answer()
        if status != 200 or "-" in headers.get("x-ckptd-chunk-sizes", "-"):
            raise RuntimeError(f"read answered {status} {headers}: {bytes(body[:300])!r}")
        return len(body)


def spread(port: int, jobs: Sequence[Any], work: Callable[[Connection, Any], object],
           connections: int = CONNECTIONS) -> float:
    """Runs ``work(connection, job)`` for every job over ``connections`` keep-alive
    connections at once; the seconds it took."""
    conns = [Connection(port) for _ in range(connections)]
    errors: list[BaseException] = []

    def run(conn: Connection, mine: Sequence[Any]) -> None:
        try:
            for job in mine:
                work(conn, job)
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c, jobs[i::connections]))
               for i, c in enumerate(conns)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for c in conns:
        c.close()
    if errors:
        raise errors[0]
    return seconds


# ---------------------------------------------------------------- floors


def hash_floor(chunks: Chunks) -> float:
    """CPU seconds, on this thread, of blake3 of every chunk once (one thread)."""
    t0 = time.thread_time()
    for d in chunks.data:
        blake3.blake3(d, max_threads=1).digest()
    return time.thread_time() - t0


class WriteFloor:
    """Writes each chunk to a file of its own, in the page cache, on a thread of its
    own, in step with the server: chunk i once the server has stored chunk i.

    In step, because what a write to the page cache costs here depends on where its
    pages come from: memory this VM gave back to its host (free page reporting)
    costs several times what a page freed a moment ago does, and which one a write
    gets changes from second to second. Writing beside the server, the floor gets
    the same mix the server gets."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(exist_ok=True)
        self.cpu = 0.0  # the writing thread's CPU seconds
        self.fsync_cpu = 0.0  # and fsync of the files afterwards (what the store adds)
        self._queue: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._count = 0

    def stored(self, data: bytearray) -> None:
        self._queue.put(data)

    def _run(self) -> None:
        paths: list[Path] = []
        while (data := self._queue.get()) is not None:
            path = self.folder / f"{len(paths):06d}"
            t0 = time.thread_time()
            with open(path, "wb") as f:
                f.write(data)
            self.cpu += time.thread_time() - t0
            paths.append(path)
        t0 = time.thread_time()
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.fsync_cpu = time.thread_time() - t0
        for path in paths:
            path.unlink()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def overwrite_floor(chunks: Chunks, folder: Path) -> float:
    """CPU seconds, on this thread, of writing every chunk over a file's pages
    already in the page cache (no page to allocate): the copy alone."""
    path = folder / "overwrite"
    with open(path, "wb") as f:
        f.write(chunks.data[0])
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            t0 = time.thread_time()
            for d in chunks.data:
                os.pwrite(fd, d, 0)
            return time.thread_time() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink()


class Drain:
    """A loopback TCP connection whose far end a thread reads and throws away."""

    def __init__(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.sock = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
        listener.close()
        self._thread = threading.Thread(target=self._drain, args=(far,), daemon=True)
        self._thread.start()

    @staticmethod
    def _drain(far: socket.socket) -> None:
        buf = bytearray(4 * MiB)
        with far:
            while far.recv_into(buf):
                pass

    def close(self) -> None:
        self.sock.close()
        self._thread.join(30)


def egress_floor(paths: Sequence[Path]) -> float:
    """CPU seconds, on this thread, of reading each file into a reused buffer and
    sending it on a loopback TCP connection."""
    drain = Drain()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        t0 = time.thread_time()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                n = f.readinto(buf)
            drain.sock.sendall(view[:n])
        return time.thread_time() - t0
    finally:
        view.release()
        drain.close()


# ---------------------------------------------------------------- measuring


@dataclass
class Measured:
    """One path's rounds: its CPU, its paired floor and its speed."""

    name: str
    target: float
    note: str
    cpu: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    gbps: list[float] = field(default_factory=list)

    def add(self, cpu: float, floor: float, gbps: float) -> None:
        self.cpu.append(cpu)
        self.floor.append(floor)
        self.gbps.append(gbps)

    def row(self) -> dict[str, Any]:
        ratios = [c / f for c, f in zip(self.cpu, self.floor, strict=True) if f]
        return {
            "path": self.name,
            "cpu_s_per_gib": statistics.median(self.cpu),
            "floor_cpu_s_per_gib": statistics.median(self.floor),
            "gbps": statistics.median(self.gbps),
            "target": f"<= {self.target:g}x floor",
            "note": self.note,
            "ratio": statistics.median(ratios) if ratios else float("nan"),
            "rounds": len(self.cpu),
            "spread": f"{min(ratios):.2f}x - {max(ratios):.2f}x" if ratios else "-",
        }


def one_round(server: Server, proc: psutil.Process, chunks: Chunks,
              scratch: Path) -> dict[str, float]:
    """One round of every server path, each beside its floor: CPU seconds and
    wall seconds of the whole state."""
    out: dict[str, float] = {}
    quiesce()
    out["floor hash"] = hash_floor(chunks)
    out["floor overwrite"] = overwrite_floor(chunks, scratch)
    writes = WriteFloor(scratch / "floor")

    def put(conn: Connection, job: tuple[str, bytearray]) -> None:
        conn.put(*job)
        writes.stored(job[1])

    try:
        c0 = cpu_seconds(proc)
        out["ingest s"] = spread(server.port, list(zip(chunks.ids, chunks.data, strict=True)),
                                 put)
        out["ingest cpu"] = cpu_seconds(proc) - c0
    finally:
        writes.close()
    out["floor write"] = writes.cpu
    out["floor fsync"] = writes.fsync_cpu
    files = [server.store / "chunks" / cid[:2] / cid for cid in chunks.ids]
    out["floor egress"] = egress_floor(files)
    batches = [chunks.ids[i:i + READ_BATCH] for i in range(0, len(chunks.ids), READ_BATCH)]
    c0 = cpu_seconds(proc)
    out["read s"] = spread(server.port, batches, lambda conn, ids: conn.read(ids),
                           connections=4)
    out["read cpu"] = cpu_seconds(proc) - c0
    c0 = cpu_seconds(proc)
    out["get s"] = spread(server.port, chunks.ids, lambda conn, cid: conn.get(cid),
                          connections=4)
    out["get cpu"] = cpu_seconds(proc) - c0
    return out


def server_rows(nbytes: int, rounds: int, parent: str | None = None,
                log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], list[str]]:
    """The server's rows (ingest, egress) and notes on what else was measured."""
    chunks = Chunks(nbytes)
    gib = sum(len(d) for d in chunks.data) / GiB
    ingest = Measured("server ingest (PUT chunks: parse, verify, store)", INGEST_TARGET,
                      "floor: blake3 once + write to the page cache")
    egress_read = Measured(f"server egress, store tier ({READ_BATCH} chunks per POST "
                           "/v1/chunks/read)", EGRESS_TARGET,
                           "floor: read into a buffer + send on loopback TCP")
    egress_get = Measured("server egress, GET /v1/chunks/{id}", EGRESS_TARGET,
                          "floor: read into a buffer + send on loopback TCP")
    fsyncs: list[float] = []
    overwrites: list[float] = []
    with scratch_dir(parent, "ckptd-dataplane-") as scratch, \
            Server(scratch / "store", scratch / "server.log") as server:
        assert server.proc is not None
        proc = psutil.Process(server.proc.pid)
        # One untimed round first: the server's buffers and the store's directories
        # exist from then on, as in a server that has run a while.
        for generation in range(rounds + 1):
            chunks.renew(generation)
            try:
                r = one_round(server, proc, chunks, scratch)
            finally:
                # Every round stores new chunks into a store of the same size.
                shutil.rmtree(server.store / "chunks", ignore_errors=True)
            floor_in = (r["floor hash"] + r["floor write"]) / gib
            log(f"round {generation}{' (warm-up, not counted)' if not generation else ''}: "
                f"ingest {r['ingest cpu'] / gib:.2f} CPU-s/GiB against a floor of "
                f"{floor_in:.2f} (blake3 {r['floor hash'] / gib:.2f} + write "
                f"{r['floor write'] / gib:.2f}, over cached pages "
                f"{r['floor overwrite'] / gib:.2f}; fsync {r['floor fsync'] / gib:.2f}), "
                f"{gib * GiB / r['ingest s'] / 1e9:.2f} GB/s; egress: read "
                f"{r['read cpu'] / gib:.2f}, GET {r['get cpu'] / gib:.2f} against "
                f"{r['floor egress'] / gib:.2f}")
            if not generation:
                continue
            ingest.add(r["ingest cpu"] / gib, floor_in, gib * GiB / r["ingest s"] / 1e9)
            egress_read.add(r["read cpu"] / gib, r["floor egress"] / gib,
                            gib * GiB / r["read s"] / 1e9)
            egress_get.add(r["get cpu"] / gib, r["floor egress"] / gib,
                           gib * GiB / r["get s"] / 1e9)
            fsyncs.append(r["floor fsync"] / gib)
            overwrites.append(r["floor overwrite"] / gib)
    notes = ["The server also fsyncs every chunk and its directory; fsync of the floor's "
             f"files took {statistics.median(fsyncs):.2f} CPU-s per GiB (median), which the "
             "ingest floor leaves out.",
             "The floor's writes run beside the server's, chunk for chunk, so both get pages of "
             "the same kind (on this VM a page its host took back costs several times a "
             "recycled one); the same bytes written over pages already cached took "
             f"{statistics.median(overwrites):.2f} CPU-s per GiB."]
    return [ingest.row(), egress_read.row(), egress_get.row()], notes


def client_rows(nbytes: int, rounds: int, parent: str | None,
                log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], list[str]]:
    """The client's rows from ``bench.dataplane_client``, when it is there."""
    try:
        module = importlib.import_module("bench.dataplane_client")
    except ImportError:
        return [], ["bench/dataplane_client.py is not in this tree: no client rows."]
    rows: list[dict[str, Any]] = module.client_rows(nbytes, rounds=rounds, parent=parent)
    return rows, []


def _fmt(value: object, spec: str) -> str:
    if isinstance(value, int | float):
        return format(value, spec)
    return "-" if value is None else str(value)


def table(rows: Sequence[dict[str, Any]], nbytes: int, rounds: int,
          notes: Sequence[str]) -> Table:
    t = Table(f"Data plane, {size_label(nbytes)} in 4 MiB chunks, median of {rounds} rounds",
              ["path", "CPU-s per GiB", "floor CPU-s per GiB", "ratio", "ratio range", "GB/s",
               "target", "met", "note"])
    for r in rows:
        ratio = r.get("ratio")
        if not isinstance(ratio, int | float):
            cpu, floor = r.get("cpu_s_per_gib"), r.get("floor_cpu_s_per_gib")
            ratio = cpu / floor if isinstance(cpu, int | float) and floor else None
        target = str(r.get("target", ""))
        met = "-"
        limit = target.removeprefix("<=").strip().split("x")[0]
        with contextlib.suppress(ValueError):
            if isinstance(ratio, int | float):
                met = "yes" if ratio <= float(limit) else "no"
        t.add(r.get("path", "?"), _fmt(r.get("cpu_s_per_gib"), ".2f"),
              _fmt(r.get("floor_cpu_s_per_gib"), ".2f"),
              fmt_x(ratio) if isinstance(ratio, int | float) else "-",
              r.get("spread", "-"), _fmt(r.get("gbps"), ".2f"), target, met,
              r.get("note", ""))
    for n in notes:
        t.note(n)
    t.note("CPU-s per GiB: the process's user + system time (psutil) per GiB of chunk bytes, "
           "every thread; the floor is measured on one thread in the same round. ratio: the "
           "median over rounds of each round's CPU over its own floor.")
    return t


@contextlib.contextmanager
def _timed_section(name: str) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="bytes per path (default 1G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-only", action="store_true", help="leave out the client's rows")
    ap.add_argument("--scratch", default=None, help="where stores and floors write")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    nbytes = parse_size(args.size)

    with scratch_dir(args.scratch) as work:
        facts = machine(work)
    for key, value in facts:
        print(f"{key}: {value}")
    with _timed_section("server rows"):
        rows, notes = server_rows(nbytes, args.rounds, args.scratch)
    if not args.server_only:
        with _timed_section("client rows"):
            more, more_notes = client_rows(nbytes, args.rounds, args.scratch)
        rows += more
        notes += more_notes
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    notes.append(f"load average at the end: {load}")
    t = table(rows, nbytes, args.rounds, notes)
    t.print()
    if args.markdown:
        lines = ["| what | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in facts]
        Path(args.markdown).write_text("\n".join(lines) + "\n\n" + t.markdown())


if __name__ == "__main__":
    main()
