"""Save benchmarks: ckptd against torch.save, DCP and a plain copy, side by side.

    python -m bench.save                      # 256 MiB and 1 GiB, 3 rounds, every section
    python -m bench.save --quick              # 256 MiB, 2 rounds
    python -m bench.save --large              # adds 4 GiB
    python -m bench.save --sections stall,memory --sizes 1G --markdown out.md

Sections (each prints a table with ratio columns):

- ``stall``: stall (from the call until the loop may change its tensors again) and
  time to committed, for every system, median of ``--rounds`` rounds that alternate
  between systems (their order rotates each round) on the same state.
- ``incremental``: ckptd after 10% of the bytes changed: bytes sent against the bytes
  changed, time against the full save.
- ``replicas``: 4 data-parallel replicas (4 processes) save the same state at once:
  bytes sent and stored against one replica; DCP with 4 gloo ranks beside it.
- ``memory``: peak memory of a process that saves twice (warm), over the state's
  size, per system; and the ckptd server's peak, per state size.

Every round's state is new to a content-addressed store (one byte in every 4 KiB
changes between rounds), so every ckptd save in ``stall`` is a first full save.
Systems that keep a staging buffer (DCP's DefaultStager, ckptd) save once untimed
in their turn first, on a state that differs in another byte, so the timed save is
warm; that untimed save's stall is the "cold" column. The copy floor (one copy into
an already touched buffer) is timed right before every timed save, and stalls are
divided by that neighbouring copy: other load on the machine moves both alike.
bench/RESULTS.md records the figures and what they mean against the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    ROUND_OFFSET,
    WARMUP_OFFSET,
    CopyFloor,
    GiB,
    MiB,
    Samples,
    Server,
    Table,
    chunks_touched,
    dir_bytes,
    edit_regions,
    edit_strided,
    fmt_gbps,
    fmt_s,
    fmt_x,
    fsync_dir,
    human_bytes,
    machine,
    make_state,
    parse_size,
    prefix_regions,
    proc_status,
    quiesce,
    ratio,
    release_free_memory,
    rotated,
    scratch_dir,
    size_label,
    state_nbytes,
    tensors_of,
    timed,
    top_layers_regions,
)

# dcp.save without a process group says, every time, that it assumes one process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

TABLES: list[Table] = []
FLOOR = "copy into touched buffer (floor)"
RUN = f"{time.strftime('%H%M%S')}-{os.getpid()}"  # job names: unique per run
FIGURES: dict[str, Any] = {}  # what the target summary reads


def show(table: Table) -> None:
    table.print()
    TABLES.append(table)
    sys.stdout.flush()


def have_ckptd() -> bool:
    try:
        from ckptd.client import Checkpointer  # noqa: F401
    except Exception as exc:  # the client may be mid-rewrite: bench the peers anyway
        print(f"ckptd.client unavailable, ckptd rows skipped: {exc!r}", file=sys.stderr)
        return False
    return True


# ---------------------------------------------------------------- systems


@dataclass
class Outcome:
    stall: float
    committed: float | None  # None: the system has no durable result (the copy floor)
    extra: dict[str, Any] | None = None


class System:
    """One way to save a state. ``open`` may allocate what it reuses; ``save`` is
    timed; ``close`` frees everything, so that only one system's buffers are alive
    at a time (4 GiB states fit)."""

    name = ""
    warm_up = False  # keeps a buffer between saves: save once untimed first

    def open(self, state: Any, work: Path) -> None:
        self.work = work

    def save(self, state: Any, step: int) -> Outcome:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Remove the last save's files (not counted)."""

    def close(self) -> None:
        pass


class RawWrite(System):
    """The state's bytes written to one file in 16 MiB writes, then fsync: the least
    that time to committed can cost on this disk."""

    name = "raw write + fsync (floor)"

    def save(self, state: Any, step: int) -> Outcome:
        path = self.work / "raw.bin"

        def go() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in tensors_of(state):
                    mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    for i in range(0, len(mv), 16 * MiB):
                        os.write(fd, mv[i : i + 16 * MiB])
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.work)

        t, _ = timed(go)
        return Outcome(t, t)

    def cleanup(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.work / "raw.bin")


class ChunkFiles(System):
    """The state's bytes as chunk-sized files the way a local ckptd store lays them out
    (``chunks/<2 hex>/<name>``, each written to a temporary name, fsync'd, linked into
    place, its directory fsync'd), one at a time and without hashing: what that layout
    costs this disk. Not a floor: ckptd writes several chunks at once."""

    name = "chunk files, fsync each, serial"

    def save(self, state: Any, step: int) -> Outcome:
        from ckptd import knobs

        chunk = knobs.chunk_size()
        root = self.work / "chunks"

        def go() -> None:
            n = 0
            for t in tensors_of(state):
                mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(mv), chunk):
                    d = root / f"{n % 256:02x}"
                    d.mkdir(parents=True, exist_ok=True)
                    tmp = d / f".tmp-{n}"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    try:
                        os.write(fd, mv[i : i + chunk])
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.link(tmp, d / f"{n:08d}")
                    os.unlink(tmp)
                    fsync_dir(d)
                    n += 1

        t, _ = timed(go)
        return Outcome(t, t)

    def cleanup(self) -> None:
        shutil.rmtree(self.work / "chunks", ignore_errors=True)


class TorchSave(System):
    name = "torch.save + fsync"

    def save(self, state: Any, step: int) -> Outcome:
        path = self.work / "state.pt"

        def go() -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.work)

        t, _ = timed(go)
        return Outcome(t, t)

    def cleanup(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.work / "state.pt")


class DcpSave(System):
    name = "dcp.save FileSystemWriter"

    def _dir(self, step: int) -> Path:
        return self.work / f"dcp-{step}"

    def save(self, state: Any, step: int) -> Outcome:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(self._dir(step), sync_files=True)
        t, _ = timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))
        return Outcome(t, t)

    def cleanup(self) -> None:
        for p in self.work.glob("dcp-*"):
            shutil.rmtree(p, ignore_errors=True)


class DcpAsyncDefault(DcpSave):
    """``dcp.async_save`` as it comes: FileSystemWriter is its own stager
    (BlockingAsyncStager: a fresh CPU copy per save, blocking), one upload thread."""

    name = "dcp.async_save (default)"

    def save(self, state: Any, step: int) -> Outcome:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(self._dir(step), sync_files=True)
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
        staging = getattr(fut, "staging_completion", None)
        if staging is not None:
            staging.result()
        stall = time.perf_counter() - t0
        upload = getattr(fut, "upload_completion", fut)
        upload.result()
        return Outcome(stall, time.perf_counter() - t0)


class DcpAsyncDefaultStager(DcpSave):
    """``dcp.async_save`` with a reused ``DefaultStager``: staging in a background
    thread into cached shared-memory storages (pinned memory and non-blocking copies
    need an accelerator, so they are off here). The stall includes waiting for that
    staging, because the loop may not change its tensors before it ends."""

    name = "dcp.async_save DefaultStager"
    warm_up = True

    def open(self, state: Any, work: Path) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().open(state, work)
        acc = torch.accelerator.is_available()
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=acc, use_shared_memory=True, use_async_staging=True,
            use_non_blocking_copy=acc,
        ))

    def save(self, state: Any, step: int) -> Outcome:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(self._dir(step), sync_files=True)
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=writer, async_stager=self.stager,
                              no_dist=True)
        resp.staging_completion.result()
        stall = time.perf_counter() - t0
        resp.upload_completion.result()
        return Outcome(stall, time.perf_counter() - t0)

    def close(self) -> None:
        self.stager.close()


class Ckptd(System):
    """ckptd's ``Checkpointer``: the stall is ``save()`` plus ``staged()``; committed
    is when ``wait()`` returns."""

    warm_up = True

    def __init__(self, url_of: Callable[[Path], str], label: str, job: str) -> None:
        self.url_of = url_of
        self.name = f"ckptd {label}"
        self.job = job

    def open(self, state: Any, work: Path) -> None:
        from ckptd.client import Checkpointer

        super().open(state, work)
        self.ckpt = Checkpointer(self.url_of(work), self.job, rank=0, world_size=1)

    def save(self, state: Any, step: int) -> Outcome:
        t0 = time.perf_counter()
        h = self.ckpt.save(step, state)
        h.staged()
        stall = time.perf_counter() - t0
        res = h.wait()
        committed = time.perf_counter() - t0
        if res.state != "committed":
            raise RuntimeError(f"{self.name}: step {step} is {res.state}, not committed")
        return Outcome(stall, committed, {
            "bytes_sent": res.bytes_sent, "chunks_sent": res.chunks_sent,
            "chunks_total": res.chunks_total, "stage": res.stage_seconds,
            "upload": res.upload_seconds, "total": res.total_seconds,
        })

    def close(self) -> None:
        self.ckpt.close()


# ---------------------------------------------------------------- stall and time to committed


def smoke(systems: list[System], work: Path) -> None:
    """Every system saves a tiny state once, untimed: imports and first-call set-up
    are paid before anything is measured."""
    tiny = make_state(2 * MiB, seed=99)
    for s in systems:
        d = work / "smoke"
        d.mkdir(exist_ok=True)
        s.open(tiny, d)
        s.save(tiny, 1)
        s.cleanup()
        s.close()
        shutil.rmtree(d, ignore_errors=True)


# --systems: name prefixes of the systems to run (empty: all).
ONLY: list[str] = []


def chosen(systems: list[System]) -> list[System]:
    """The systems ``--systems`` names, plus torch.save and dcp.save (the peers every
    ratio is taken against, measured in the same run)."""
    if not ONLY:
        return systems
    keep = (*ONLY, TorchSave.name, DcpSave.name)
    return [s for s in systems if s.name.startswith(keep)]


def bench_stall(nbytes: int, rounds: int, work: Path, server: Server | None, ckptd: bool) -> None:
    label = size_label(nbytes)
    print(f"\n== stall and time to committed, {label} state, {rounds} rounds", flush=True)
    t, state = timed(lambda: make_state(nbytes, seed=1))
    real = state_nbytes(state)
    print(f"   state: {len(tensors_of(state))} tensors, {human_bytes(real)}, built in {fmt_s(t)}")

    systems: list[System] = [RawWrite(), ChunkFiles(), TorchSave(), DcpSave(),
                             DcpAsyncDefault(), DcpAsyncDefaultStager()]
    tag = f"{RUN}-{nbytes // MiB}m"
    if ckptd:
        store = work / "file-store"
        if server is not None:
            systems.append(Ckptd(lambda _w: server.url, "http:// (server)", f"http-{tag}"))
        systems.append(Ckptd(lambda _w: f"file://{store}", "file://", f"file-{tag}"))
    systems = chosen(systems)

    # The copy floor is timed right before every other system's timed save, and each
    # stall is divided by the copy next to it: other processes on this machine's two
    # cores slow a copy by up to ten times, and a neighbour in time shares that load.
    t, floor = timed(lambda: CopyFloor(state))
    samples = Samples()
    samples.add(FLOOR, "cold", t)
    step = 0
    for r in range(rounds):
        edit_strided(state, ROUND_OFFSET, 1)  # this round's state: new to every store
        load = os.getloadavg()[0]
        for s in rotated(systems, r):
            d = work / "out"
            d.mkdir(exist_ok=True)
            s.open(state, d)
            try:
                if s.warm_up:
                    edit_strided(state, WARMUP_OFFSET, 1)
                    quiesce()
                    step += 1
                    cold = s.save(state, step)
                    s.cleanup()
                    edit_strided(state, WARMUP_OFFSET, -1)
                quiesce()
                copy, _ = timed(floor.copy)
                step += 1
                out = s.save(state, step)
            finally:
                s.cleanup()
                s.close()
                shutil.rmtree(d, ignore_errors=True)
            samples.add(FLOOR, "stall", copy)
            samples.add(s.name, "copy", copy)
            samples.add(s.name, "stall", out.stall)
            samples.add(s.name, "stall/copy", out.stall / copy)
            if s.warm_up:
                samples.add(s.name, "cold", cold.stall)
                samples.add(s.name, "cold/copy", cold.stall / copy)
            if out.committed is not None:
                samples.add(s.name, "committed", out.committed)
            for k, v in (out.extra or {}).items():
                samples.add(s.name, k, v)
            print(f"   round {r + 1} (load {load:.1f}): {s.name:30s} copy {fmt_s(copy):>8s}  "
                  f"stall {fmt_s(out.stall):>8s} ({fmt_x(out.stall / copy):>6s})  committed "
                  f"{fmt_s(out.committed):>8s}", flush=True)
    floor.close()

    copy = samples.median(FLOOR, "stall")
    tsave = samples.median(TorchSave.name, "stall")
    dcp = samples.median(DcpSave.name, "committed")
    table = Table(
        f"Stall and time to committed, {label} state ({human_bytes(real)}), median of {rounds}",
        ["system", "stall", "stall range", "stall / copy (paired)", "stall / torch.save",
         "cold stall / copy", "committed", "committed / dcp.save", "GB/s to committed"],
    )
    table.add(FLOOR, fmt_s(copy), samples.spread(FLOOR, "stall"), "1.00x",
              fmt_x(ratio(copy, tsave)), fmt_x(ratio(samples.median(FLOOR, "cold"), copy)),
              "-", "-", "-")
    for s in systems:
        st = samples.median(s.name, "stall")
        cm = samples.median(s.name, "committed")
        table.add(s.name, fmt_s(st), samples.spread(s.name, "stall"),
                  fmt_x(samples.median(s.name, "stall/copy")), fmt_x(ratio(st, tsave)),
                  fmt_x(samples.median(s.name, "cold/copy")), fmt_s(cm),
                  fmt_x(ratio(cm, dcp)), fmt_gbps(real, cm))
    table.note("stall: from the call until the tensors may change again (DCP async: "
               "staging_completion included). stall / copy: the median, over rounds, of "
               "the stall over a copy of the state into a touched buffer timed just "
               "before it. committed: until the save is durable (fsync'd) and, for "
               "ckptd, committed. cold: the first save into a fresh staging buffer "
               "(allocation, page faults), over the paired copy; not in the other columns.")
    show(table)
    FIGURES.setdefault("stall", {})[nbytes] = {
        name: {k: samples.median(name, k) for k in samples.values.get(name, {})}
        for name in [FLOOR] + [s.name for s in systems]
    }

    ck = [s for s in systems if isinstance(s, Ckptd)]
    if ck:
        hash_t = blake3_seconds(state)
        tb = Table(f"Where ckptd's time goes, {label} state (median of {rounds})",
                   ["system", "stage (client)", "hash to committed (client)",
                    "that / blake3 of the state", "that / raw write+fsync",
                    "that / chunk files, serial", "bytes sent / state", "chunks sent"])
        raw = samples.median(RawWrite.name, "committed")
        files = samples.median(ChunkFiles.name, "committed")
        for s in ck:
            up = samples.median(s.name, "upload")
            tb.add(s.name, fmt_s(samples.median(s.name, "stage")), fmt_s(up),
                   fmt_x(ratio(up, hash_t)), fmt_x(ratio(up, raw)), fmt_x(ratio(up, files)),
                   fmt_x(ratio(samples.median(s.name, "bytes_sent"), real)),
                   f"{samples.median(s.name, 'chunks_sent'):.0f} / "
                   f"{samples.median(s.name, 'chunks_total'):.0f}")
        tb.note(f"blake3 of the whole state with all threads, measured in this run: "
                f"{fmt_s(hash_t)} ({fmt_gbps(real, hash_t)} GB/s). 'hash to committed' is "
                "the client's upload_seconds: hashing, the missing-chunks call, uploads, "
                "the manifest and the commit.")
        show(tb)


def blake3_seconds(state: Any) -> float:
    """Median time to blake3 every tensor's bytes with all threads (no copy)."""
    import blake3

    views = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors_of(state)]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for v in views:
            blake3.blake3(v, max_threads=blake3.blake3.AUTO).digest()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


# ---------------------------------------------------------------- incremental


def bench_incremental(nbytes: int, work: Path, server: Server | None) -> None:
    from ckptd import knobs
    from ckptd.client import Checkpointer

    label = size_label(nbytes)
    print(f"\n== incremental, {label} state", flush=True)
    state = make_state(nbytes, seed=2)
    real = state_nbytes(state)
    chunk = knobs.chunk_size()
    configs = []
    if server is not None:
        configs.append(("ckptd http:// (server)", server.url, chunk))
    configs.append(("ckptd file://", f"file://{work / 'incr-store'}", chunk))
    # Smaller chunks: what finer granularity buys when changes are scattered.
    configs.append((f"ckptd file://, {human_bytes(MiB)} chunks", f"file://{work / 'incr-store-1m'}",
                    MiB))
    table = Table(
        f"Incremental save after 10% of the bytes changed, {label} state, one run each",
        ["system", "change", "bytes changed", "bytes sent", "sent / changed",
         "sent / chunks touched", "committed", "committed / full save"],
    )
    for name, url, chunk in configs:
        job = f"incr-{RUN}-{nbytes // MiB}m-{len(table.rows)}"
        with Checkpointer(url, job, chunk_size=chunk) as ckpt:

            def save(step: int) -> tuple[float, Any]:
                quiesce()
                t0 = time.perf_counter()
                h = ckpt.save(step, state)
                res = h.wait()
                return time.perf_counter() - t0, res

            edit_strided(state, WARMUP_OFFSET, 1)
            save(1)  # warm the staging buffers
            edit_strided(state, WARMUP_OFFSET, -1)
            full_t, full = save(2)
            table.add(name, "none: first full save", "-", human_bytes(full.bytes_sent),
                      fmt_x(ratio(full.bytes_sent, real)) + " of state", "-", fmt_s(full_t),
                      "1.00x")
            for what, regions in (
                ("top layers, whole tensors", top_layers_regions(state, 0.10)),
                ("first 10% of every tensor", prefix_regions(state, 0.10)),
            ):
                changed = edit_regions(state, regions, 1)
                touched = chunks_touched(state, regions, chunk)
                t, res = save(3 + len(table.rows))
                table.add(name, what, human_bytes(changed), human_bytes(res.bytes_sent),
                          fmt_x(ratio(res.bytes_sent, changed)),
                          fmt_x(ratio(res.bytes_sent, touched)), fmt_s(t),
                          fmt_x(ratio(t, full_t)))
                FIGURES.setdefault("incremental", {}).setdefault(nbytes, {})[(name, what)] = {
                    "sent": res.bytes_sent, "changed": changed, "touched": touched,
                    "t": t, "full_t": full_t,
                }
    table.note(f"chunk size {human_bytes(knobs.chunk_size())} unless named. 'chunks "
               "touched': the bytes of the fixed-offset chunks the changed regions "
               "overlap, what any chunk-level incremental save must send. Each change is "
               "on top of the previous save.")
    show(table)


# ---------------------------------------------------------------- replicas


def _replica_worker(url: str, job: str, rank: int, world: int, nbytes: int,
                    barrier: Any, queue: Any) -> None:
    try:
        from ckptd.client import Checkpointer

        state = make_state(nbytes, seed=3)
        with Checkpointer(url, job, rank=rank, world_size=world) as ckpt:
            barrier.wait()
            t0 = time.time()
            h = ckpt.save(1, state)
            stall = time.time() - t0
            res = h.wait()
            queue.put({"rank": rank, "start": t0, "end": time.time(), "stall": stall,
                       "sent": res.bytes_sent, "dedup": res.bytes_deduplicated,
                       "state": res.state})
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _dcp_replica_worker(path: str, init: str, rank: int, world: int, nbytes: int,
                        barrier: Any, queue: Any) -> None:
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        state = make_state(nbytes, seed=3)
        if world > 1:
            dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                    world_size=world)
        barrier.wait()
        t0 = time.time()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                 no_dist=world == 1)
        queue.put({"rank": rank, "start": t0, "end": time.time(), "stall": time.time() - t0})
        if world > 1:
            dist.destroy_process_group()
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _run_group(target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]],
               world: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), barrier, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError("a worker failed:\n" + errors[0])
    return sorted(out, key=lambda o: o["rank"])


def bench_replicas(nbytes: int, work: Path, ckptd: bool) -> None:
    label = size_label(nbytes)
    print(f"\n== 4 data-parallel replicas, {label} state", flush=True)
    real = state_nbytes(make_state(nbytes, seed=3))
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for world in (1, 4):
        quiesce()
        if ckptd:
            store = work / f"replica-store-{world}"
            with Server(store, work / f"server-replicas-{world}.log") as srv:
                job = f"replicas-{world}"
                out = _run_group(_replica_worker,
                                 lambda r, srv=srv, job=job, world=world:
                                 (srv.url, job, r, world, nbytes), world)
                peak = srv.status()["VmHWM"] - srv.baseline["VmRSS"]
            states = {o["state"] for o in out}
            if "committed" not in states:
                raise RuntimeError(f"replicas: no rank saw the step committed: {states}")
            rows.setdefault("ckptd http:// (server)", {})[world] = {
                "sent": sum(o["sent"] for o in out),
                "stored": dir_bytes(store / "chunks"),
                "t": max(o["end"] for o in out) - min(o["start"] for o in out),
                "stall": max(o["stall"] for o in out),
                "server_peak": peak,
            }
            shutil.rmtree(store, ignore_errors=True)
        quiesce()
        path = work / f"dcp-replicas-{world}"
        init = work / f"dcp-init-{world}"
        out = _run_group(_dcp_replica_worker,
                         lambda r, path=path, init=init, world=world:
                         (str(path), str(init), r, world, nbytes), world)
        rows.setdefault("dcp.save FileSystemWriter (gloo)", {})[world] = {
            "sent": float("nan"),
            "stored": dir_bytes(path),
            "t": max(o["end"] for o in out) - min(o["start"] for o in out),
            "stall": max(o["stall"] for o in out),
        }
        shutil.rmtree(path, ignore_errors=True)

    table = Table(
        f"4 data-parallel replicas saving the same {label} state at once, against one replica",
        ["system", "bytes sent, 4 replicas", "sent / one replica's", "bytes stored, 4 replicas",
         "stored / one replica's", "stored / state", "committed, 4", "committed 4 / 1"],
    )
    for name, by in rows.items():
        one, four = by[1], by[4]
        table.add(name, human_bytes(four["sent"]), fmt_x(ratio(four["sent"], one["sent"])),
                  human_bytes(four["stored"]), fmt_x(ratio(four["stored"], one["stored"])),
                  fmt_x(ratio(four["stored"], real)), fmt_s(four["t"]),
                  fmt_x(ratio(four["t"], one["t"])))
    table.note("Four processes on 2 cores. ckptd: bytes sent summed over ranks; stored: "
               "the store's chunks/ directory. DCP: its planner gives each replicated "
               "tensor to one rank (a collective plan); nothing is 'sent' over a network.")
    show(table)
    FIGURES.setdefault("replicas", {})[nbytes] = rows


# ---------------------------------------------------------------- memory


def _memory_worker(kind: str, target: str, nbytes: int, conn: Any) -> None:
    """Builds the state, reports ready, saves twice (the second warm) when told to go."""
    try:
        state = make_state(nbytes, seed=4)
        release_free_memory()
        conn.send("ready")
        assert conn.recv() == "go"
        work = Path(target)
        if kind.startswith("ckptd"):
            from ckptd.client import Checkpointer

            url = target if "://" in target else f"file://{target}"
            with Checkpointer(url, f"mem-{os.getpid()}") as ckpt:
                for step in (1, 2):
                    edit_strided(state, WARMUP_OFFSET, 1)
                    ckpt.save(step, state).wait()
        else:
            system: System = {"torch.save": TorchSave, "dcp.async_save (default)": DcpAsyncDefault,
                              "dcp.async_save DefaultStager": DcpAsyncDefaultStager}[kind]()
            system.open(state, work)
            for step in (1, 2):
                edit_strided(state, WARMUP_OFFSET, 1)
                system.save(state, step)
                system.cleanup()
            system.close()
        conn.send("done")
        assert conn.recv() == "exit"
    except BaseException:
        conn.send("error:" + traceback.format_exc())


def _measure_child(kind: str, target: str, nbytes: int) -> dict[str, int]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_memory_worker, args=(kind, target, nbytes, child))
    p.start()
    msg = parent.recv()
    if msg != "ready":
        raise RuntimeError(msg)
    base = proc_status(p.pid)
    peak_resident = 0
    parent.send("go")
    while not parent.poll(0.005):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            st = proc_status(p.pid)
            peak_resident = max(peak_resident, st["RssAnon"] + st["RssShmem"])
    msg = parent.recv()
    if msg != "done":
        raise RuntimeError(msg)
    end = proc_status(p.pid)
    peak_resident = max(peak_resident, end["RssAnon"] + end["RssShmem"])
    parent.send("exit")
    p.join(60)
    return {
        "hwm_over": end["VmHWM"] - base["VmRSS"],
        "resident_over": peak_resident - (base["RssAnon"] + base["RssShmem"]),
    }


def bench_memory(sizes: list[int], work: Path, ckptd: bool) -> None:
    print("\n== peak memory", flush=True)
    kinds = ["torch.save", "dcp.async_save (default)", "dcp.async_save DefaultStager"]
    if ckptd:
        kinds += ["ckptd http:// (server)", "ckptd file://"]
    table = Table(
        "Peak memory of a process that saves its state twice, over the state's own memory",
        ["system", "state", "peak RSS over state (VmHWM)", "/ state",
         "peak anon+shm over state (sampled)", "/ state", "server peak RSS over idle",
         "server peak / chunk size"],
    )
    from ckptd import knobs

    for nbytes in sizes:
        for kind in kinds:
            quiesce()
            d = work / "mem"
            d.mkdir(exist_ok=True)
            server_peak = None
            if kind.startswith("ckptd http"):
                with Server(work / "mem-store", work / "server-mem.log") as srv:
                    m = _measure_child(kind, srv.url, nbytes)
                    server_peak = srv.status()["VmHWM"] - srv.baseline["VmRSS"]
            elif kind.startswith("ckptd file"):
                m = _measure_child(kind, str(work / "mem-store"), nbytes)
            else:
                m = _measure_child(kind, str(d), nbytes)
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(work / "mem-store", ignore_errors=True)
            table.add(kind, size_label(nbytes), human_bytes(m["hwm_over"]),
                      fmt_x(m["hwm_over"] / nbytes), human_bytes(m["resident_over"]),
                      fmt_x(m["resident_over"] / nbytes),
                      human_bytes(server_peak) if server_peak is not None else "-",
                      fmt_x(server_peak / knobs.chunk_size()) if server_peak is not None else "-")
            FIGURES.setdefault("memory", {}).setdefault(nbytes, {})[kind] = {
                **m, "server_peak": server_peak}
            print(f"   {kind:32s} {size_label(nbytes):>8s}  peak over state "
                  f"{human_bytes(m['hwm_over'])}", flush=True)
    table.note("Each system runs in its own fresh process (spawned), which builds the "
               "state, then saves twice on a state that changes in between; the peak "
               "over the RSS it had before the first save. anon+shm counts /dev/shm "
               "pages the process maps; sampled every 5 ms by the parent. The server is "
               "a fresh `ckptd serve` per state size; its peak is over its RSS after start.")
    show(table)


# ---------------------------------------------------------------- targets


def targets_table(sizes: list[int]) -> None:
    table = Table("Targets of ckptd's design", ["target", "state", "measured", "met"])

    def verdict(value: float, limit: float, lower_is_better: bool = True) -> str:
        if math.isnan(value):
            return "-"
        ok = value <= limit if lower_is_better else value >= limit
        return "yes" if ok else f"no ({value / limit:.2f}x the limit)"

    for nbytes in sizes:
        st = FIGURES.get("stall", {}).get(nbytes)
        if not st:
            continue
        tsave = st[TorchSave.name]["stall"]
        dcp = st[DcpSave.name]["committed"]
        for name in [n for n in st if n.startswith("ckptd")]:
            s = st[name]["stall"]
            sc = st[name]["stall/copy"]
            c = st[name]["committed"]
            lab = size_label(nbytes)
            table.add(f"{name}: stall <= 1.2x copy", lab, fmt_x(sc), verdict(sc, 1.2))
            table.add(f"{name}: stall <= 0.1x torch.save", lab, fmt_x(s / tsave),
                      verdict(s / tsave, 0.1))
            table.add(f"{name}: committed <= dcp.save", lab, fmt_x(c / dcp), verdict(c / dcp, 1.0))
    for nbytes, by in FIGURES.get("incremental", {}).items():
        for (name, what), f in by.items():
            r = f["sent"] / f["changed"]
            table.add(f"{name}: incremental sent <= 1.1x changed ({what})", size_label(nbytes),
                      fmt_x(r), verdict(r, 1.1))
    for nbytes, rows in FIGURES.get("replicas", {}).items():
        by = rows.get("ckptd http:// (server)")
        if by:
            for k in ("sent", "stored"):
                r = by[4][k] / by[1][k]
                table.add(f"4 replicas: {k} <= 1.1x one replica", size_label(nbytes), fmt_x(r),
                          verdict(r, 1.1))
    for nbytes, by in FIGURES.get("memory", {}).items():
        for kind, m in by.items():
            if kind.startswith("ckptd"):
                r = m["hwm_over"] / nbytes
                table.add(f"{kind}: client peak over state <= 1.1x state", size_label(nbytes),
                          fmt_x(r), verdict(r, 1.1))
    show(table)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.save", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256M,1G", help="state sizes (default 256M,1G)")
    ap.add_argument("--large", action="store_true", help="add a 4 GiB state")
    ap.add_argument("--quick", action="store_true", help="256M only, 2 rounds")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per system (default 3)")
    ap.add_argument("--sections", default="stall,incremental,replicas,memory")
    ap.add_argument("--replica-size", default="256M", help="state size per replica (default 256M)")
    ap.add_argument("--dir", default=None,
                    help="scratch directory parent: every system writes to this one disk "
                         "(default: the system temp dir)")
    ap.add_argument("--markdown", default=None, help="also write the tables here, as markdown")
    ap.add_argument("--systems", default=None,
                    help="stall section: only systems whose name starts with one of these "
                         "(comma-separated); torch.save and dcp.save, the ratios' peers, stay")
    args = ap.parse_args(argv)
    if args.systems:
        ONLY[:] = [p.strip() for p in args.systems.split(",") if p.strip()]

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    rounds = args.rounds
    if args.quick:
        sizes, rounds = [256 * MiB], min(rounds, 2)
    if args.large and 4 * GiB not in sizes:
        sizes.append(4 * GiB)
    sections = set(args.sections.split(","))
    ckptd = have_ckptd()
    started = time.perf_counter()

    with scratch_dir(args.dir) as work:
        info = machine(work)
        command = "python -m bench.save " + " ".join(sys.argv[1:] if argv is None else argv)
        mtable = Table("Machine", ["what", "value"])
        mtable.add("command", command.strip())
        for k, v in info:
            mtable.add(k, v)
        show(mtable)

        if "stall" in sections or "incremental" in sections:
            server_cm = Server(work / "server-store", work / "server.log") if ckptd else None
            with server_cm if server_cm is not None else contextlib.nullcontext() as server:
                if "stall" in sections:
                    systems: list[System] = [RawWrite(), ChunkFiles(), TorchSave(), DcpSave(),
                                             DcpAsyncDefault(), DcpAsyncDefaultStager()]
                    if ckptd:
                        systems.append(Ckptd(lambda _w: server.url, "http", f"smoke-{RUN}"))
                        systems.append(Ckptd(lambda _w: f"file://{work / 'smoke-store'}", "file",
                                             f"smoke-{RUN}"))
                    smoke(chosen(systems), work)
                    for nbytes in sizes:
                        bench_stall(nbytes, rounds, work, server, ckptd)
                if "incremental" in sections and ckptd:
                    for nbytes in sizes:
                        bench_incremental(nbytes, work, server)
                if server is not None:
                    st = server.status()
                    t = Table("ckptd server over the stall and incremental sections",
                              ["idle RSS", "peak RSS (VmHWM)", "peak over idle",
                               "peak over idle / largest state"])
                    t.add(human_bytes(server.baseline["VmRSS"]), human_bytes(st["VmHWM"]),
                          human_bytes(st["VmHWM"] - server.baseline["VmRSS"]),
                          fmt_x((st["VmHWM"] - server.baseline["VmRSS"]) / max(sizes)))
                    show(t)
        if "replicas" in sections:
            bench_replicas(parse_size(args.replica_size), work, ckptd)
        if "memory" in sections:
            bench_memory(sizes, work, ckptd)
        targets_table(sizes)
        print(f"\ntotal {fmt_s(time.perf_counter() - started)}, load average at the end "
              + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    if args.markdown:
        Path(args.markdown).write_text("\n".join(t.markdown() for t in TABLES))


if __name__ == "__main__":
    main()
