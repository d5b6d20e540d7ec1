"""``ckptd demo``: a server on a temporary store, a 2-rank CPU training run that
loses a rank and recovers, and a bitwise comparison with an undisturbed run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ckptd.client import Checkpointer
from ckptd.client.transport_http import SyncTransport
from ckptd.errors import CkptdError, InvalidRequest

TRAIN_SCRIPT = Path(__file__).with_name("demo_train.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(store: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--store", str(store), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    with SyncTransport(url, timeout=1.0, retries=0) as server:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {log}")
            try:
                server.healthz()
                return proc, url
            except CkptdError:
                time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start; see {log}")


def _torchrun(
    url: str, job: str, steps: int, nproc: int, events: Path, log: Path, kill: bool,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "--max-restarts=2", "--monitor-interval=0.5",
        str(TRAIN_SCRIPT), "--url", url, "--job", job, "--steps", str(steps),
        "--events", str(events),
    ]
    if kill:
        args += ["--kill-rank", str(nproc - 1), "--kill-at", str(steps // 2 - 3)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    offset = events.stat().st_size if events.exists() else 0
    deadline = time.monotonic() + 600
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            # While it trains, say what the ranks did (events they append), so a
            # minute of training is not a minute of silence.
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    rc = None
                offset = _new_events(events, offset, on_event)
                if rc is not None:
                    return rc
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, 600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=15)


def _new_events(
    events: Path, offset: int, on_event: Callable[[dict[str, Any]], None] | None
) -> int:
    """Calls ``on_event`` for each whole line appended since ``offset``; the new offset."""
    if on_event is None or not events.exists():
        return offset
    with open(events, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            on_event(json.loads(line))
    return offset + end


def _say(console: Console, event: dict[str, Any], steps: int) -> None:
    """One line per thing the ranks did while training: rank 0's saves, a kill, a restore."""
    kind = event.get("kind")
    if kind == "saved" and event.get("rank") == 0:
        console.print(f"   step {event['step']}/{steps} trained, checkpoint saved "
                      f"(loss {event.get('loss', float('nan')):.4f})")
    elif kind == "killed":
        console.print(f"   rank {event['rank']} killed at step {event['step']}; torchrun restarts "
                      "the workers")
    elif kind == "restored" and event.get("rank") == 0:
        console.print(f"   workers restarted, restoring step {event['step']} from ckptd")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = tree
    return out


def _same(a: Any, b: Any) -> bool:
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return False
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and torch.equal(va, vb)):
                return False
        elif va != vb:
            return False
    return True


def run_demo(
    workdir: str | None = None, steps: int = 40, nproc: int = 2, console: Console | None = None
) -> bool:
    """Runs the demo; True when the recovered run ends bitwise equal to the reference."""
    console = console or Console()
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ckptd-demo-"))
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        # A store of an earlier run there would be restored from: nothing killed, and
        # the comparison proves nothing. (Nothing there is deleted: it may be anyone's.)
        raise InvalidRequest(f"--workdir {root} is not a new or empty directory: name one "
                             "for this run's store, logs and events")
    root.mkdir(parents=True, exist_ok=True)
    store, events, logs = root / "store", root / "events.jsonl", root / "logs"
    logs.mkdir(exist_ok=True)
    events.unlink(missing_ok=True)
    console.print(f"[bold]ckptd demo[/] in {root}")
    server, url = _start_server(store, logs / "server.log")
    try:
        console.print(f"server on {url}, store {store}")
        console.print(f"1. reference run: {nproc} ranks, {steps} steps, no failure")
        t0 = time.monotonic()
        rc = _torchrun(url, "reference", steps, nproc, events, logs / "reference.log", kill=False,
                       on_event=lambda e: _say(console, e, steps))
        if rc != 0:
            console.print(f"[red]reference run failed[/] (exit {rc}); see {logs / 'reference.log'}")
            return False
        console.print(f"   done in {time.monotonic() - t0:.1f}s")
        kill_at = steps // 2 - 3
        console.print(
            f"2. faulty run: rank {nproc - 1} is killed (SIGKILL) at step {kill_at} "
            "(or later, once a checkpoint has committed)"
        )
        t0 = time.monotonic()
        rc = _torchrun(url, "faulty", steps, nproc, events, logs / "faulty.log", kill=True,
                       on_event=lambda e: _say(console, e, steps))
        if rc != 0:
            console.print(f"[red]faulty run failed[/] (exit {rc}); see {logs / 'faulty.log'}")
            return False
        console.print(f"   done in {time.monotonic() - t0:.1f}s")
        seen = [json.loads(line) for line in events.read_text().splitlines()]
        for e in seen:
            if e["kind"] == "killed":
                console.print(f"   rank {e['rank']} died at step {e['step']}")
        for e in seen:
            if e["kind"] == "restored":
                console.print(
                    f"   rank {e['rank']} restarted and restored step {e['step']} "
                    f"({e['bytes']} bytes) in {e['seconds'] * 1000:.0f} ms"
                )
        if not any(e["kind"] == "restored" for e in seen):
            console.print("[red]no rank restored: the failure was not exercised[/]")
            return False

        console.print("3. compare the final checkpoints of both runs")
        final: dict[str, dict[str, Any]] = {}
        for job in ("reference", "faulty"):
            with Checkpointer(url, job=job, rank=0, world_size=nproc) as ckpt:
                state: dict[str, Any] = {}
                ckpt.restore(state, step=steps)
                final[job] = state
        same = _same(final["reference"], final["faulty"])
        if same:
            n = sum(1 for v in _flatten(final["faulty"]).values() if isinstance(v, torch.Tensor))
            console.print(
                f"[bold green]OK[/]: the recovered run's model and optimizer ({n} tensors) at "
                f"step {steps} equal the undisturbed run's, bitwise"
            )
        else:
            console.print("[bold red]MISMATCH[/]: the recovered run differs from the reference")
        return same
    finally:
        server.terminate()
        server.wait(timeout=15)
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
