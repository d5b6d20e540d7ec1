"""The data plane in one table: CPU seconds per GiB of every path chunk bytes cross,
beside the floor for the same bytes measured in the same run.

    python -m bench.dataplane                        # 1 GiB, 3 rounds, every row
    python -m bench.dataplane --size 256M --rounds 2 --server-only
    python -m bench.dataplane --markdown out.md

The server's rows (this module), against a real ``ckptd serve`` over a local
directory store, its CPU read with psutil (user + system, every thread):

- **ingest** (rank -> server): 4 MiB chunks ``PUT /v1/chunks/{id}`` over 8
  keep-alive connections; the server parses, verifies (blake3) and stores each
  (temporary file, fsync, link). Floor (issue 21's): blake3 of the bytes once (one
  thread) plus writing them to the page cache, one file per chunk, timed on one
  thread (``time.thread_time``) in the same round. The same CPU beside a durable
  floor: receiving the bytes from loopback TCP (``recv_into``), blake3, and the
  store's own put (fsync and all), serial and without HTTP: what is left over it
  is what the HTTP path costs. Every write goes into pages freed a moment before
  (see ``one_round``: on this VM the alternative costs up to ten times as much,
  varying from second to second).
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
import mmap
import os
import shutil
import socket
import statistics
import threading
import time
from collections import defaultdict
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
    data: list[mmap.mmap] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        for start in range(0, self.nbytes, CHUNK):
            # Page-aligned, as the server's upload buffers are: the durable floor's
            # put then writes them as the server's store does (ckptd.store.direct_io).
            size = min(CHUNK, self.nbytes - start)
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            buf[:] = rng.bytes(size)
            self.data.append(buf)
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

    def put(self, cid: str, data: mmap.mmap) -> int:
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


def spread(conns: Sequence[Connection], jobs: Sequence[Any],
           work: Callable[[Connection, Any], object]) -> float:
    """Runs ``work(connection, job)`` for every job over the keep-alive connections
    ``conns`` at once; the seconds it took."""
    errors: list[BaseException] = []

    def run(conn: Connection, mine: Sequence[Any]) -> None:
        try:
            for job in mine:
                work(conn, job)
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c, jobs[i::len(conns)]))
               for i, c in enumerate(conns)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
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


def write_floor(chunks: Sequence[mmap.mmap], folder: Path) -> float:
    """CPU seconds, on this thread, of writing each chunk to a file of its own in the
    page cache; the files are deleted again (untimed)."""
    folder.mkdir(exist_ok=True)
    paths = [folder / f"{i:06d}" for i in range(len(chunks))]
    t0 = time.thread_time()
    for path, data in zip(paths, chunks, strict=True):
        with open(path, "wb") as f:
            f.write(data)
    used = time.thread_time() - t0
    for path in paths:
        path.unlink()
    return used


def durable_put_floor(ids: Sequence[str], chunks: Sequence[mmap.mmap], folder: Path) -> float:
    """CPU seconds, on this thread, of putting each chunk as the store itself does
    (``LocalStore``'s own put, as its worker thread runs it in the server: a
    temporary file, write, fsync, link, the directory's fsync) into a scratch store,
    removed again (untimed)."""
    from ckptd.store.local import LocalStore

    store = LocalStore(folder / "store")
    t0 = time.thread_time()
    for cid, data in zip(ids, chunks, strict=True):
        store._put_if_absent(f"chunks/{cid[:2]}/{cid}", memoryview(data))
    used = time.thread_time() - t0
    shutil.rmtree(folder / "store")
    return used


def recv_floor(chunks: Chunks) -> float:
    """CPU seconds of receiving every chunk from loopback TCP into a reused buffer
    (``recv_into``), on the receiving thread: what a network server cannot avoid."""
    listener = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(listener.getsockname())
    far, _ = listener.accept()
    listener.close()

    def send() -> None:
        with out:
            for d in chunks.data:
                out.sendall(d)

    sender = threading.Thread(target=send, daemon=True)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with far:
        sender.start()
        t0 = time.thread_time()
        for d in chunks.data:
            got = 0
            while got < len(d):
                got += far.recv_into(view[got:len(d)])
        used = time.thread_time() - t0
    sender.join(30)
    view.release()
    return used


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
    sending it on a loopback TCP connection, page cache warm (as the server reads
    them next: the store wrote them around the cache)."""
    drain = Drain()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            f.readinto(buf)
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
            "target": f"<= {self.target:g}x floor" if self.target else "-",
            "note": self.note,
            "ratio": statistics.median(ratios) if ratios else float("nan"),
            "rounds": len(self.cpu),
            "spread": f"{min(ratios):.2f}x - {max(ratios):.2f}x" if ratios else "-",
        }


# Chunks per slice of a round: small enough that every write of a slice lands in
# pages freed by the step just before it (see ``one_round``).
SLICE = 32


def one_round(server: Server, proc: psutil.Process, chunks: Chunks,
              scratch: Path) -> dict[str, float]:
    """One round of every server path, each beside its floors: CPU seconds and wall
    seconds of the whole state, summed over slices of ``SLICE`` chunks.

    Each slice's writes (the floors', then the server's) go into page-cache pages
    that the step just before freed: the last slice's store files, then the floor's
    files, then the durable floor's. On this VM a write into a page its host has
    taken back (free page reporting, a second or two after the page was freed, or
    another process's taking) costs up to ten times a write into a page just freed
    (0.2 - 2.5 CPU-s per GiB, from one second to the next), which would swamp floors
    and server alike; a server on bare metal writes into pages as cheap as those."""
    out: dict[str, float] = defaultdict(float)
    quiesce()
    out["floor hash"] = hash_floor(chunks)
    out["floor recv"] = recv_floor(chunks)
    writers = [Connection(server.port) for _ in range(CONNECTIONS)]
    readers = [Connection(server.port) for _ in range(4)]
    try:
        for start in range(0, len(chunks.ids), SLICE):
            ids, data = chunks.ids[start:start + SLICE], chunks.data[start:start + SLICE]
            shutil.rmtree(server.store / "chunks", ignore_errors=True)  # the last slice's
            out["floor write"] += write_floor(data, scratch / "floor")
            out["floor durable put"] += durable_put_floor(ids, data, scratch / "floor")
            c0 = cpu_seconds(proc)
            out["ingest s"] += spread(writers, list(zip(ids, data, strict=True)),
                                      lambda conn, job: conn.put(*job))
            out["ingest cpu"] += cpu_seconds(proc) - c0
            files = [server.store / "chunks" / cid[:2] / cid for cid in ids]
            out["floor egress"] += egress_floor(files)
            batches = [ids[i:i + READ_BATCH] for i in range(0, len(ids), READ_BATCH)]
            c0 = cpu_seconds(proc)
            out["read s"] += spread(readers, batches, lambda conn, b: conn.read(b))
            out["read cpu"] += cpu_seconds(proc) - c0
            c0 = cpu_seconds(proc)
            out["get s"] += spread(readers, ids, lambda conn, cid: conn.get(cid))
            out["get cpu"] += cpu_seconds(proc) - c0
    finally:
        for conn in writers + readers:
            conn.close()
    return out


def server_rows(nbytes: int, rounds: int, parent: str | None = None,
                log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], list[str]]:
    """The server's rows (ingest, egress) and notes on what else was measured."""
    chunks = Chunks(nbytes)
    gib = sum(len(d) for d in chunks.data) / GiB
    ingest = Measured("server ingest (PUT chunks: parse, verify, store)", INGEST_TARGET,
                      "floor: blake3 once + write to the page cache")
    durable = Measured("server ingest, beside a durable floor (what HTTP adds)", 0.0,
                       "floor: recv_into + blake3 + the store's own put (temp file, write, "
                       "fsync, link, directory fsync), serial, no HTTP")
    egress_read = Measured(f"server egress, store tier ({READ_BATCH} chunks per POST "
                           "/v1/chunks/read)", EGRESS_TARGET,
                           "floor: read into a buffer + send on loopback TCP")
    egress_get = Measured("server egress, GET /v1/chunks/{id}", EGRESS_TARGET,
                          "floor: read into a buffer + send on loopback TCP")
    with scratch_dir(parent, "ckptd-dataplane-") as scratch, \
            Server(scratch / "store", scratch / "server.log") as server:
        assert server.proc is not None
        proc = psutil.Process(server.proc.pid)
        # One untimed round first: the server's buffers and the store's directories
        # exist from then on, as in a server that has run a while.
        for generation in range(rounds + 1):
            chunks.renew(generation)
            r = one_round(server, proc, chunks, scratch)
            floor_in = (r["floor hash"] + r["floor write"]) / gib
            floor_durable = (r["floor recv"] + r["floor hash"] + r["floor durable put"]) / gib
            log(f"round {generation}{' (warm-up, not counted)' if not generation else ''}: "
                f"ingest {r['ingest cpu'] / gib:.2f} CPU-s/GiB against a floor of "
                f"{floor_in:.2f} (blake3 {r['floor hash'] / gib:.2f} + write "
                f"{r['floor write'] / gib:.2f}) and a durable floor of "
                f"{floor_durable:.2f} (recv {r['floor recv'] / gib:.2f} + blake3 + the "
                f"store's put {r['floor durable put'] / gib:.2f}), "
                f"{gib * GiB / r['ingest s'] / 1e9:.2f} GB/s; egress: read "
                f"{r['read cpu'] / gib:.2f}, GET {r['get cpu'] / gib:.2f} against "
                f"{r['floor egress'] / gib:.2f}")
            if not generation:
                continue
            ingest.add(r["ingest cpu"] / gib, floor_in, gib * GiB / r["ingest s"] / 1e9)
            durable.add(r["ingest cpu"] / gib, floor_durable, gib * GiB / r["ingest s"] / 1e9)
            egress_read.add(r["read cpu"] / gib, r["floor egress"] / gib,
                            gib * GiB / r["read s"] / 1e9)
            egress_get.add(r["get cpu"] / gib, r["floor egress"] / gib,
                           gib * GiB / r["get s"] / 1e9)
    notes = ["Every write, the floors' and the server's, goes into page-cache pages freed a "
             "moment before (bench/dataplane.py, one_round)."]
    return [ingest.row(), durable.row(), egress_read.row(), egress_get.row()], notes


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
