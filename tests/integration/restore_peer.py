"""A rank in its own process, for the restore tests: it saves a deterministic
state as one rank of a job and then serves its pool to peers until it is killed
(optionally killing itself with SIGKILL after serving a given number of chunks:
a peer that dies in the middle of someone's restore).

Usage: restore_peer.py URL JOB RANK WORLD STEP SEED NBYTES CHUNK DIE_AFTER [stage-only]
       [low-precision]

Prints ``READY <peer url>`` once its save is done. ``stage-only`` saves and then
SIGKILLs itself at once (a crashed worker whose pool stays in shared memory).
``low-precision`` adds the low-precision dtypes' tensors (``low_precision_tensors``).
Reads the token from ``CKPTD_TEST_TOKEN``. The tests start it with ``spawn`` and
wait for it with ``wait_ready`` and ``wait_held`` (below).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

HELPER = Path(__file__)
TOKEN = "tier-token"
CHUNK = 16384


LOW_PRECISION = ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")


def low_precision_tensors(seed: int) -> dict[str, torch.Tensor]:
    """One tensor of each low-precision dtype: every bit pattern, then random bytes,
    three chunks and a part of one (torch has no arithmetic on them: made as bytes)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in LOW_PRECISION:
        raw = torch.cat([torch.arange(256, dtype=torch.uint8),
                         torch.randint(0, 256, (3 * CHUNK + 256,), generator=g,
                                       dtype=torch.uint8)])
        out[name] = raw.view(-1, 64).view(getattr(torch, name))
    return out


def make_state(seed: int, nbytes: int, low_precision: bool = False) -> dict[str, Any]:
    """A training-like state of about ``nbytes`` bytes, the same for every seed; with
    ``low_precision``, ``low_precision_tensors`` under ``lowp``."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4 // 4)
    state: dict[str, Any] = {
        "model": {
            "embed.weight": torch.randn(n, generator=g),
            "mlp.weight": torch.randn(2 * n, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(64),
        },
        "optim": {"state": {0: {"exp_avg": torch.randn(n, generator=g),
                                "step": torch.tensor(5.0)}},
                  "param_groups": [{"lr": 0.001, "params": [0]}]},
        "step": 5,
    }
    if low_precision:
        state["lowp"] = low_precision_tensors(seed)
    return state


# -- starting it from a test -----------------------------------------------------------


def spawn(url: str, job: str, rank: int, world: int, step: int, seed: int, nbytes: int,
          die_after: int = 0, stage_only: bool = False, low_precision: bool = False
          ) -> subprocess.Popen[str]:
    env = dict(os.environ, CKPTD_TEST_TOKEN=TOKEN)
    args = [sys.executable, str(HELPER), url, job, str(rank), str(world), str(step), str(seed),
            str(nbytes), str(CHUNK), str(die_after)] + (["stage-only"] if stage_only else [])
    args += ["low-precision"] if low_precision else []
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def wait_ready(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("READY "):
            return line.split()[1]
    proc.kill()
    raise AssertionError("peer process did not get ready:\n" + "".join(lines))


def held_steps(server: Any, job: str) -> dict[int, Any]:
    resp = httpx.get(f"{server.url}/v1/jobs/{job}/ranks", headers=server.headers(), timeout=10)
    if resp.status_code != 200:
        return {}
    return {r["rank"]: r["held_step"] for r in resp.json()["ranks"] if r["state"] != "dead"}


def wait_held(server: Any, job: str, ranks: list[int], step: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = held_steps(server, job)
        if all(held.get(r) == step for r in ranks):
            return
        time.sleep(0.05)
    raise AssertionError(f"ranks {ranks} never held step {step}: {held_steps(server, job)}")


def main() -> None:
    url, job = sys.argv[1], sys.argv[2]
    rank, world, step, seed = (int(a) for a in sys.argv[3:7])
    nbytes, chunk, die_after = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
    stage_only = "stage-only" in sys.argv[10:]
    low_precision = "low-precision" in sys.argv[10:]
    token = os.environ.get("CKPTD_TEST_TOKEN") or None

    from ckptd.client import Checkpointer
    from ckptd.client.peer import PeerServer

    if die_after > 0:
        served = {"n": 0}
        lock = threading.Lock()
        original = PeerServer.serve_chunk

        def serve_then_die(self: PeerServer, handler: Any, cid: str) -> None:
            original(self, handler, cid)
            with lock:
                served["n"] += 1
                if served["n"] >= die_after:
                    os.kill(os.getpid(), signal.SIGKILL)

        PeerServer.serve_chunk = serve_then_die  # type: ignore[method-assign]

    ckpt = Checkpointer(url, job, rank=rank, world_size=world, token=token, chunk_size=chunk,
                        heartbeat_interval=0.2)
    handle = ckpt.save(step, make_state(seed, nbytes, low_precision))
    handle.wait(timeout=120)
    if stage_only:
        os.kill(os.getpid(), signal.SIGKILL)
    peer = ckpt.peer_server
    print(f"READY {peer.url if peer is not None else '-'}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
