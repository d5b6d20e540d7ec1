"""A data-parallel training worker for the chaos test (run by torchrun, gloo on
the CPU): a small deterministic MLP and AdamW, gradients averaged with
``all_reduce``, a snapshot every few steps. On start it re-adopts its shared-memory
pool, restores the latest committed step (from its pool, peers or the store) and
resumes. An ``Injector`` (deterministic per seed) kills one rank with SIGKILL at
planned steps, sometimes deleting that rank's pool first (a lost node) or
corrupting the store's copy of a chunk the restore will need.

Usage: chaos_worker.py OUT URL JOB STEPS EVERY PLAN_JSON STORE_DIR

Writes ``OUT/events-<rank>.jsonl`` (restores, first completed step of each attempt),
``OUT/kills.jsonl`` (one line per kill, written just before it) and, at the end,
``OUT/rank<r>.json`` (digests of the final parameters and optimizer state).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist

HIDDEN = 192
FEATURES = 48
BATCH = 32


@dataclass(frozen=True)
class Kill:
    """Kill ``rank`` at the start of ``step`` during attempt ``attempt``."""

    attempt: int
    rank: int
    step: int
    wipe: bool  # delete the rank's shared-memory pool first: a lost node
    corrupt: bool  # corrupt the store's copy of a chunk the restore needs


def kill_plan(seed: int, steps: int, world: int, kills: int, every: int) -> list[Kill]:
    """The kills of a run, deterministic per seed: one per attempt, in rising steps
    (each in its own stretch of the run, so the resumed run reaches it), at least
    one lost node, and the last one corrupting the store (a lost node whose
    snapshot is committed, so that peers hold it)."""
    rng = random.Random(seed)
    stretch = (steps - every) // kills
    plan = []
    for i in range(kills):
        lo = every + 1 + i * stretch
        step = rng.randrange(lo, lo + stretch - 1)
        corrupt = i == kills - 1
        if corrupt:  # right after a snapshot step
            step = lo + (1 - lo) % every
        plan.append(Kill(attempt=i, rank=rng.randrange(world), step=step,
                         wipe=corrupt or i == 1 or rng.random() < 0.4, corrupt=corrupt))
    return plan


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 131 + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = (x[:, :8].sum(dim=1, keepdim=True) > 0).float()
    return x, y


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, optim


def digests(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """blake3 of every parameter and optimizer-state tensor's bytes, and the
    optimizer's param groups: equal exactly when the state is bitwise equal."""

    def h(t: torch.Tensor) -> str:
        t = t.detach().contiguous()
        return f"{t.dtype}{list(t.shape)}:" + blake3.blake3(
            t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    out: dict[str, Any] = {f"model.{k}": h(v) for k, v in model.state_dict().items()}
    sd = optim.state_dict()
    for pid, st in sd["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = h(v) if isinstance(v, torch.Tensor) else v
    out["param_groups"] = json.loads(json.dumps(sd["param_groups"]))
    return out


class Log:
    def __init__(self, path: Path, **base: Any) -> None:
        self.f = open(path, "a")  # noqa: SIM115 - open for the process's life
        self.base = base

    def __call__(self, kind: str, **kw: Any) -> None:
        self.f.write(json.dumps({"kind": kind, "t": time.time(), **self.base, **kw}) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


class Injector:
    """Kills this rank when the plan says so (one kill per attempt), after
    recording the kill."""

    def __init__(self, plan: list[Kill], attempt: int, rank: int, out: Path,
                 store: Path) -> None:
        self.kill = next((k for k in plan if k.attempt == attempt and k.rank == rank), None)
        self.out = out
        self.store = store
        self.fired = 0

    def maybe_kill(self, step: int, ckpt: Any, job: str, handles: list[Any]) -> None:
        k = self.kill
        if k is None or k.step != step:
            return
        record: dict[str, Any] = asdict(k)
        if k.corrupt:
            # Let the last snapshot commit (every rank's pool then holds it), then
            # damage the store's copy of one of its chunks.
            for h in handles[-1:]:
                h.wait(timeout=60)
            deadline = time.monotonic() + 30
            while ckpt.latest() != step - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            manifest = json.loads((self.store / "jobs" / job / "steps" / str(step - 1) /
                                   "ranks" / f"{k.rank}.json").read_text())
            big = max(manifest["entries"], key=lambda e: e["nbytes"])
            cid = big["chunks"][0]
            path = self.store / "chunks" / cid[:2] / cid
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            os.chmod(path, 0o644)
            path.write_bytes(bytes(data))
            record["corrupted_chunk"] = cid
            record["snapshot_step"] = step - 1
        else:
            # A kill is for a restore to mend: some step must be committed first. The
            # steps are milliseconds, so under load the first kill (2 snapshots in)
            # could come before any commit, and the restart had nothing to restore.
            deadline = time.monotonic() + 60
            while ckpt.latest() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if k.wipe:
            shutil.rmtree(ckpt.staging.directory, ignore_errors=True)
        record["t"] = time.time()
        with open(self.out / "kills.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.fired += 1
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, url, job = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    steps, every = int(sys.argv[4]), int(sys.argv[5])
    plan = [Kill(**k) for k in json.loads(sys.argv[6])]
    store = Path(sys.argv[7])
    seed = 7
    token = os.environ.get("CHAOS_TOKEN") or None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's agent keeps one store across restarts: without a prefix of its own,
    # a restarted group would read the dead attempt's gloo addresses and hang.
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"chaos/attempt-{attempt}", agent),
                            rank=rank, world_size=world)
    log = Log(out / f"events-{rank}.jsonl", rank=rank, attempt=attempt)
    log("start")

    from ckptd.client import Checkpointer

    model, optim = make_model()
    ckpt = Checkpointer(url, job, rank=rank, world_size=world, token=token, chunk_size=16384,
                        heartbeat_interval=0.5)
    injector = Injector(plan, attempt, rank, out, store)
    # Serve what this node's pool still holds of the latest commit before anyone
    # asks for a restore plan, so that a rank that lost its pool finds its peers.
    held = ckpt.adopt()
    dist.barrier()
    start = 1
    if ckpt.latest() is not None:
        state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 0}
        result = ckpt.restore(state)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = int(state["step"]) + 1
        log("restored", step=result.step, held=held, bytes_from=result.bytes_from,
            problems=[p.to_json() for p in result.problems], seconds=result.seconds,
            bytes=result.bytes_restored)
    dist.barrier()
    handles: list[Any] = []
    first = True
    for step in range(start, steps + 1):
        injector.maybe_kill(step, ckpt, job, handles)
        x, y = batch(seed, step, rank)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        optim.zero_grad(set_to_none=False)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        optim.step()
        ckpt.note_step(step)
        if step % every == 0:
            state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
            handles.append(ckpt.save(step, state))
        if first:
            log("first_step", step=step)
            first = False
    for h in handles[-1:]:
        h.wait(timeout=120)
    dist.barrier()  # every rank's last snapshot is in: the last one committed it
    result = {"rank": rank, "attempt": attempt, "digests": digests(model, optim),
              "latest": ckpt.latest()}
    ckpt.close()
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
