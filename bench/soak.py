"""A soak (issue 20 item 7): ranks save every few seconds for an hour through two
replicas over one store, with retention, garbage collection and scrub running, a
replica restarted and a rank killed now and then; then every kept step is
restored and compared bitwise, and ``ckptd verify`` must be clean. Not in CI.

    python -m bench.soak                                  # 4 ranks, 1 hour
    python -m bench.soak --duration 600 --ranks 2         # ten minutes
    nohup python -m bench.soak --out /tmp/soak > /tmp/soak.log 2>&1 &

Every ``--sample`` seconds it records the store's size and files, the committed
and pending steps, each server's RSS and open descriptors (and its census
worker's RSS), the ranks' RSS, and /healthz latency of each replica, in
``<out>/soak.csv``; events (kills, restarts) in ``<out>/events.csv``; a plot of
store size, RSS, descriptors and /healthz over time in ``<out>/soak.png``; and the
verdict in ``<out>/summary.json``: growth over the second half of the run (a
leak shows as a slope), every kept step restored bitwise, verify's exit status.

Each rank's state is a function of (step, rank), so any step can be checked
without keeping it: ``model.w`` is replicated (the same on every rank, changing
every 10 steps: data-parallel dedup), ``shard`` is the rank's own and changes one
eighth per step (an incremental save), plus the step as a value.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

from bench.common import MiB, dir_bytes, free_port
from ckptd.cluster import home, job_key

BLOCKS = 8  # the shard changes one block a step
REPLICATED_EVERY = 10  # model.w changes every this many steps


# -- the state a rank holds at a step -------------------------------------------------------


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def expected_state(step: int, rank: int, mib: float) -> dict[str, Any]:
    """What rank ``rank`` saves at ``step``: half replicated, half its own shard."""
    floats = int(mib * MiB) // 8  # float32s in each half
    block = floats // BLOCKS
    shard = torch.empty(block * BLOCKS)
    for j in range(BLOCKS):
        changed = max(0, step - ((step - j) % BLOCKS))  # the last step block j changed
        shard[j * block:(j + 1) * block] = _rand(block, 1_000_003 * rank + 7919 * j + changed)
    return {"model": {"w": _rand(floats, 17 + step // REPLICATED_EVERY)}, "shard": shard,
            "step": step}


def bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8))))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            bitwise_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def empty_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    return state


# -- one rank (a process of its own: ``python -m bench.soak rank ...``) -----------------------


def rank_main(args: argparse.Namespace) -> None:
    from ckptd.client import Checkpointer

    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def say(**event: Any) -> None:
        log.write(json.dumps({"t": time.time(), "rank": args.rank, **event}) + "\n")

    ckpt = Checkpointer(args.url, args.job, rank=args.rank, world_size=args.world,
                        shm_dir=args.shm, chunk_size=args.chunk_kib * 1024, timeout=120)
    try:
        latest = ckpt.latest()
        if latest is not None:  # a restarted rank: back to the latest step, checked
            t0 = time.perf_counter()
            try:
                target = empty_like(expected_state(latest, args.rank, args.mib))
                result = ckpt.restore(target)
                ok = bitwise_equal(target, expected_state(result.step, args.rank, args.mib))
                say(event="restored", step=result.step, ok=ok, seconds=time.perf_counter() - t0,
                    tiers=result.bytes_from)
            except Exception as exc:  # said, and the rank trains on (it is a soak)
                say(event="restore_failed", error=repr(exc)[:500])
        while not stop:
            # (a rank up before the clock starts saves its first step at the start:
            # steps below 1 were saves of negative step numbers, refused)
            step = max(1, int((time.time() - args.start) // args.every) + 1)
            due = args.start + step * args.every
            while time.time() < due and not stop:
                time.sleep(max(0.0, min(0.2, due - time.time())))
            if stop:
                break
            t0 = time.perf_counter()
            try:
                state = expected_state(step, args.rank, args.mib)
                result = ckpt.save(step, state, local=["shard"]).wait(timeout=120)
                say(event="saved", step=step, state=result.state,
                    seconds=time.perf_counter() - t0, sent=result.bytes_sent)
            except Exception as exc:
                say(event="save_failed", step=step, error=repr(exc)[:500],
                    seconds=time.perf_counter() - t0)
    finally:
        with contextlib.suppress(Exception):
            ckpt.close(timeout=60)
        say(event="exit")
        log.close()


# -- the supervisor ----------------------------------------------------------------------------


RETENTION = """[retention]
keep_last = 4
abandon_pending_after = "90s"
"""


class Replica:
    def __init__(self, i: int, store: Path, out: Path, port: int, peers: list[str],
                 retention: Path, args: argparse.Namespace) -> None:
        self.i, self.port = i, port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "ckptd", "serve", "--store", str(store),
                    "--host", "127.0.0.1", "--port", str(port), "--peers", ",".join(peers),
                    "--retention", str(retention), "--gc-interval", str(args.gc_interval),
                    "--gc-grace", str(args.gc_grace), "--scrub-interval",
                    str(args.scrub_interval), "--no-access-log"]
        self.log = out / f"server-{i}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"replica {self.i} did not start; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.proc = None


class Rank:
    def __init__(self, r: int, url: str, out: Path, shm: Path, start: float,
                 args: argparse.Namespace) -> None:
        self.r = r
        self.log = out / f"rank-{r}.jsonl"
        self.cmd = [sys.executable, "-m", "bench.soak", "rank", "--url", url, "--job", args.job,
                    "--rank", str(r), "--world", str(args.ranks), "--shm", str(shm),
                    "--start", repr(start), "--every", str(args.every), "--mib", str(args.mib),
                    "--chunk-kib", str(args.chunk_kib), "--log", str(self.log)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.err = out / f"rank-{r}.err"

    def start(self) -> None:
        with open(self.err, "ab") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=err, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None


def _rss(pid: int | None) -> tuple[int, int, int]:
    """(RSS, open descriptors, RSS of its children) of a process; zeros if gone."""
    if pid is None:
        return 0, 0, 0
    try:
        p = psutil.Process(pid)
        kids = sum(c.memory_info().rss for c in p.children(recursive=True))
        return p.memory_info().rss, p.num_fds(), kids
    except psutil.Error:
        return 0, 0, 0


def _health(url: str) -> float:
    worst = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            httpx.get(f"{url}/healthz", timeout=10)
            worst = max(worst, time.perf_counter() - t0)
        except httpx.HTTPError:
            return float("nan")  # (a replica being restarted)
    return worst


def _steps(store: Path, job: str) -> tuple[list[int], int]:
    """(committed steps, pending steps) from the store's directories."""
    root = store / "jobs" / job / "steps"
    committed, pending = [], 0
    for d in root.iterdir() if root.is_dir() else ():
        if not d.name.isdigit():
            continue
        if (d / "commit.json").exists():
            committed.append(int(d.name))
        elif (d / "ranks").is_dir() and any((d / "ranks").iterdir()):
            pending += 1
    return sorted(committed), pending


def _slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (per hour)."""
    if len(ts) < 3:
        return float("nan")
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var \
        else float("nan")


def _rank_events(out: Path, ranks: int) -> list[dict[str, Any]]:
    events = []
    for r in range(ranks):
        path = out / f"rank-{r}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
    return events


def supervise(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: results, logs and the store in {out}", flush=True)
    store = out / "store"
    retention = out / "retention.toml"
    retention.write_text(RETENTION)
    shm = Path(tempfile.mkdtemp(prefix="ckptd-soak-", dir="/dev/shm"))
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [Replica(i, store, out, p, urls, retention, args) for i, p in enumerate(ports)]
    start = time.time() + 15  # the ranks' step clock (they take seconds to import torch)
    ranks = [Rank(r, urls[r % len(urls)], out, shm, start, args) for r in range(args.ranks)]
    rng = random.Random(args.seed)
    columns = ["t", "store_bytes", "store_files", "chunk_files", "committed", "pending",
               "step_dirs", "lock_files",
               *(f"server{i}_{k}" for i in range(args.replicas)
                 for k in ("rss", "fds", "worker_rss", "healthz_ms")),
               "ranks_rss", "ranks_fds"]
    samples = open(out / "soak.csv", "w", newline="")  # noqa: SIM115
    writer = csv.writer(samples)
    writer.writerow(columns)
    events = open(out / "events.csv", "w", newline="")  # noqa: SIM115
    event_writer = csv.writer(events)
    event_writer.writerow(["t", "event", "what"])
    t_begin = time.time()

    def event(kind: str, what: str) -> None:
        event_writer.writerow([round(time.time() - t_begin, 1), kind, what])
        events.flush()
        print(f"[{time.time() - t_begin:7.0f} s] {kind} {what}", flush=True)

    # The job's home replica (its commits, manifests and heartbeats go there) stays
    # up the whole run unless --restart any: the witness for what grows with commits.
    job_home = home(job_key(args.job), urls)
    restartable = [r for r in replicas if args.restart == "any" or r.url != job_home]
    rows: list[dict[str, float]] = []
    try:
        for rep in replicas:
            rep.start()
        for rank in ranks:
            rank.start()
        event("start", f"{args.ranks} ranks x {args.mib} MiB every {args.every} s, "
                       f"{args.replicas} replicas, {args.duration} s; the job's home is "
                       f"replica {urls.index(job_home)}")
        next_sample = next_kill = next_restart = time.monotonic()
        next_kill += args.kill_every
        next_restart += args.restart_every
        revive: list[tuple[float, Rank]] = []
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            now = time.monotonic()
            for when, rank in list(revive):
                if now >= when:
                    rank.start()
                    revive.remove((when, rank))
                    event("rank_restarted", str(rank.r))
            for rank in ranks:  # a rank that died by itself is said and restarted
                if rank.proc is not None and rank.proc.poll() is not None:
                    event("rank_exited", f"{rank.r} status {rank.proc.returncode}")
                    rank.proc = None
                    revive.append((now + 5, rank))
            if now >= next_kill:
                victim = rng.choice([r for r in ranks if r.proc is not None] or ranks)
                victim.kill()
                event("rank_killed", str(victim.r))
                revive.append((now + args.down, victim))
                next_kill = now + args.kill_every
            if now >= next_restart and restartable:
                rep = rng.choice(restartable)
                event("replica_restart", str(rep.i))
                rep.stop()
                rep.start()
                next_restart = now + args.restart_every
            if now >= next_sample:
                rows.append(_sample(args, store, replicas, ranks, t_begin, writer))
                samples.flush()
                next_sample = now + args.sample
            time.sleep(0.5)
        event("stop", "ranks asked to stop")
        for rank in ranks:
            if rank.proc is not None:
                rank.proc.terminate()
        for rank in ranks:
            if rank.proc is not None:
                try:
                    rank.proc.wait(120)
                except subprocess.TimeoutExpired:
                    rank.kill()
        time.sleep(5)  # retention after the last commits
        rows.append(_sample(args, store, replicas, ranks, t_begin, writer))
        samples.flush()
        checks = _final_checks(args, store, urls[0], shm)
    finally:
        for rank in ranks:
            rank.kill()
        for rep in replicas:
            rep.stop()
        samples.close()
        events.close()
        shutil.rmtree(shm, ignore_errors=True)
    summary = _summarize(args, out, rows, checks)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _plot(out, rows, args)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


def _sample(args: argparse.Namespace, store: Path, replicas: list[Replica], ranks: list[Rank],
            t_begin: float, writer: Any) -> dict[str, float]:
    committed, pending = _steps(store, args.job)
    files = [p for p in store.rglob("*") if p.is_file()]
    steps_dir, locks = store / "jobs" / args.job / "steps", store / ".locks"
    row: dict[str, float] = {
        "t": round(time.time() - t_begin, 1), "store_bytes": dir_bytes(store),
        "store_files": len(files), "chunk_files": sum(1 for p in files if p.parts[-3] == "chunks"),
        "committed": len(committed), "pending": pending,
        # (a local store leaves a forgotten step's empty directories and a lock file
        # per key it ever compared-and-swapped: they are counted apart)
        "step_dirs": len(list(steps_dir.iterdir())) if steps_dir.is_dir() else 0,
        "lock_files": len(list(locks.iterdir())) if locks.is_dir() else 0}
    for rep in replicas:
        rss, fds, kids = _rss(rep.proc.pid if rep.proc else None)
        row |= {f"server{rep.i}_rss": rss, f"server{rep.i}_fds": fds,
                f"server{rep.i}_worker_rss": kids,
                f"server{rep.i}_healthz_ms": round(1000 * _health(rep.url), 2)}
    got = [_rss(r.proc.pid if r.proc else None) for r in ranks]
    row |= {"ranks_rss": sum(g[0] + g[2] for g in got), "ranks_fds": sum(g[1] for g in got)}
    writer.writerow([row.get(c, "") for c in
                     ["t", "store_bytes", "store_files", "chunk_files", "committed", "pending",
                      "step_dirs", "lock_files", *(f"server{i}_{k}" for i in range(len(replicas))
                        for k in ("rss", "fds", "worker_rss", "healthz_ms")),
                      "ranks_rss", "ranks_fds"]])
    return row


def _final_checks(args: argparse.Namespace, store: Path, url: str, shm: Path) -> dict[str, Any]:
    """Every committed (kept) step restored by every rank and compared bitwise; verify."""
    from ckptd.client import Checkpointer

    committed, pending = _steps(store, args.job)
    restored, failed = 0, []
    for step in committed:
        for r in range(args.ranks):
            with Checkpointer(url, args.job, rank=r, world_size=args.ranks,
                              shm_dir=shm / "check", serve_peers=False, timeout=120) as ckpt:
                target = empty_like(expected_state(step, r, args.mib))
                try:
                    ckpt.restore(target, step=step)
                    ok = bitwise_equal(target, expected_state(step, r, args.mib))
                except Exception as exc:
                    ok = False
                    failed.append(f"step {step} rank {r}: {exc!r}"[:300])
                if ok:
                    restored += 1
                elif not failed or not failed[-1].startswith(f"step {step} rank {r}:"):
                    failed.append(f"step {step} rank {r}: not bitwise the saved state")
    verify = subprocess.run([sys.executable, "-m", "ckptd", "verify", args.job, "--url", url],
                            capture_output=True, text=True, timeout=1800)
    return {"kept_steps": committed, "pending_steps": pending, "restored": restored,
            "restore_failures": failed, "verify_status": verify.returncode,
            "verify_output": (verify.stdout + verify.stderr)[-2000:]}


def _summarize(args: argparse.Namespace, out: Path, rows: list[dict[str, float]],
               checks: dict[str, Any]) -> dict[str, Any]:
    events = _rank_events(out, args.ranks)
    saved = [e for e in events if e.get("event") == "saved"]
    half = [r for r in rows if r["t"] >= rows[-1]["t"] / 2] if rows else []

    def series(key: str, part: list[dict[str, float]] | None = None) -> list[float]:
        return [float(r[key]) for r in (rows if part is None else part)
                if r.get(key) not in ("", None) and r[key] == r[key] and r[key] != 0]

    growth = {}
    for key in ("store_bytes", "store_files", "chunk_files", "step_dirs", "lock_files",
                *(f"server{i}_{k}" for i in range(args.replicas)
                                                  for k in ("rss", "fds", "worker_rss")),
                "ranks_rss", "ranks_fds"):
        pts = [(float(r["t"]), float(r[key])) for r in half if r.get(key)]
        values = series(key)
        quarters = [[float(r[key]) for r in rows if r.get(key) and q * rows[-1]["t"] / 4 <= r["t"]
                     < (q + 1) * rows[-1]["t"] / 4 + (q == 3)] for q in range(4)]
        growth[key] = {"quarter_means": [round(statistics.fmean(v)) if v else None
                                         for v in quarters],
                       "first": values[0] if values else None,
                       "max": max(values) if values else None,
                       "last": values[-1] if values else None,
                       "slope_per_hour_second_half": _slope([p[0] for p in pts],
                                                            [p[1] for p in pts])}
    health = [v for i in range(args.replicas) for v in series(f"server{i}_healthz_ms")]
    server_logs = "".join((out / f"server-{i}.log").read_text(errors="replace")
                          for i in range(args.replicas))
    summary = {
        "duration_s": args.duration, "ranks": args.ranks, "mib_per_rank": args.mib,
        "every_s": args.every, "replicas": args.replicas,
        "saves": len(saved), "saves_committed": sum(e.get("state") == "committed" for e in saved),
        "save_failures": sum(e.get("event") == "save_failed" for e in events),
        "save_seconds_median": statistics.median([e["seconds"] for e in saved]) if saved
        else None,
        "rank_restores": sum(e.get("event") == "restored" for e in events),
        "rank_restores_bitwise": sum(e.get("event") == "restored" and e.get("ok")
                                     for e in events),
        "rank_restore_failures": sum(e.get("event") == "restore_failed" for e in events),
        "healthz_ms": {"median": statistics.median(health) if health else None,
                       "p99": sorted(health)[int(0.99 * (len(health) - 1))] if health else None,
                       "worst": max(health) if health else None},
        "growth": growth, "final": checks,
        "server_tracebacks": server_logs.count("Traceback"),
        "server_errors": sum(" ERROR " in line for line in server_logs.splitlines()),
    }
    summary["ok"] = bool(checks["restored"] == len(checks["kept_steps"]) * args.ranks
                         and not checks["restore_failures"] and checks["verify_status"] == 0
                         and checks["kept_steps"])
    return summary


def _plot(out: Path, rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    try:
        import matplotlib
    except ImportError:
        print("soak: no plot (matplotlib is missing: pip install -e '.[bench]'); the CSV has "
              "every sample", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    minutes = [r["t"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(minutes, [r["store_bytes"] / MiB for r in rows], color="tab:blue")
    axes[0].set_ylabel("store size (MiB)")
    axes[1].plot(minutes, [r["chunk_files"] for r in rows], color="tab:blue", label="chunks")
    axes[1].plot(minutes, [r["step_dirs"] for r in rows], color="tab:orange",
                 label="step directories (empty ones included)")
    axes[1].plot(minutes, [r["lock_files"] for r in rows], color="tab:brown",
                 label=".locks files")
    axes[1].set_ylabel("count")
    axes[1].legend(fontsize=7, loc="upper left")
    for i in range(args.replicas):
        axes[2].plot(minutes, [r[f"server{i}_rss"] / MiB for r in rows], label=f"server {i}")
        axes[2].plot(minutes, [r[f"server{i}_worker_rss"] / MiB for r in rows], lw=0.8,
                     ls="--", label=f"server {i} census worker")
    axes[2].set_ylabel("server RSS (MiB)")
    axes[2].set_ylim(bottom=0)
    ranks = axes[2].twinx()
    ranks.plot(minutes, [r["ranks_rss"] / MiB / args.ranks for r in rows], lw=0.6,
               color="tab:olive", label="a rank, mean (right)")
    ranks.set_ylabel("rank RSS (MiB)")
    ranks.set_ylim(bottom=0)
    axes[2].legend(fontsize=7, ncol=2, loc="lower left")
    ranks.legend(fontsize=7, loc="lower right")
    for i in range(args.replicas):
        axes[3].plot(minutes, [r[f"server{i}_fds"] for r in rows], label=f"server {i} fds")
    axes[3].set_ylabel("open descriptors")
    health = axes[3].twinx()
    for i in range(args.replicas):
        health.plot(minutes, [r[f"server{i}_healthz_ms"] for r in rows], lw=0.6, ls=":",
                    label=f"server {i} /healthz (ms)")
    health.set_ylabel("/healthz worst of 3 (ms)")
    axes[3].legend(fontsize=7, loc="upper left")
    health.legend(fontsize=7, loc="upper right")
    axes[3].set_xlabel("minutes")
    with contextlib.suppress(OSError):
        for line in (out / "events.csv").read_text().splitlines()[1:]:
            t, kind, _ = line.split(",", 2)
            color = {"rank_killed": "tab:red", "replica_restart": "tab:purple"}.get(kind)
            if color:
                for ax in axes:
                    ax.axvline(float(t) / 60, color=color, lw=0.4, alpha=0.5)
    fig.suptitle(f"ckptd soak: {args.ranks} ranks x {args.mib} MiB every {args.every} s, "
                 f"{args.replicas} replicas (red: rank killed, purple: replica restarted)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="(internal) one rank's loop")
    for name, kind in (("--url", str), ("--job", str), ("--rank", int), ("--world", int),
                       ("--shm", str), ("--start", float), ("--every", float),
                       ("--mib", float), ("--chunk-kib", int), ("--log", str)):
        rank.add_argument(name, type=kind, required=True)
    parser.add_argument("--out", default="soak-out", help="where the CSV, plot, logs and store "
                        "go (default: soak-out in the current directory, ignored by git)")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of saving")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--mib", type=float, default=4.0, help="state per rank (MiB)")
    parser.add_argument("--every", type=float, default=4.0, help="seconds between saves")
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--job", default="soak")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--kill-every", type=float, default=300.0, help="kill a rank (s)")
    parser.add_argument("--down", type=float, default=10.0, help="a killed rank stays down (s)")
    parser.add_argument("--restart-every", type=float, default=420.0,
                        help="restart a replica (s)")
    parser.add_argument("--restart", choices=("others", "any"), default="others",
                        help="which replicas are restarted: all but the job's home (default), "
                        "or any")
    parser.add_argument("--gc-interval", type=float, default=180.0)
    parser.add_argument("--gc-grace", type=float, default=60.0)
    parser.add_argument("--scrub-interval", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "rank":
        rank_main(args)
    else:
        sys.exit(supervise(args))


if __name__ == "__main__":
    main()
