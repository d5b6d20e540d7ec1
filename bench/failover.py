"""MTTR of a lost node, taken apart (issue 19.9).

    python -m bench.failover                      # 2 failures per torchrun setting
    python -m bench.failover --rounds 3 --width 256 --markdown out.md

Runs the node-loss scenario of ``tests/multinode`` on its simulated hosts (its
harness, not a copy): ``ckptd serve`` on a host of its own, a 2 x 2-rank torchrun
job (c10d rendezvous) running the README's loop; once step 100 is committed,
node2 is SIGKILLed with its shared memory at step 150 and a replacement node3's
agent starts at once. Each failure is one row: the time from the kill to

- detection: the first surviving rank's collective fails,
- rendezvous: the first worker of the new round is forked (the agents agreed),
- group: the last rank's process group is ready,
- model: the last rank built its model, DDP wrapper and optimizer (not ckptd),
- ckptd: the last rank's ``Checkpointer`` is constructed,
- restored: the last rank's restore is done (bytes per tier, all ranks),
- first step: the last rank finished its first step after the restore;

and the steps trained twice. ckptd's own share is, on the slowest rank, the time
from constructing the ``Checkpointer`` to the end of its restore (constructing,
``latest()``, planning, fetching, verifying, its waits), set against that rank's
restore bytes at the speed of the tier each came from, measured in the same run
between the same simulated hosts (target: at most 1 s beyond). ``torch.load`` of
the same state from the replacement's /dev/shm is the peer figure.

Each torchrun setting is a row group: torch's defaults (no ``--rdzv-conf``),
the settings docs/multinode.md gives (``tests.multinode.jobs.FAST_RDZV``), and
those with a spare node whose agent was started beforehand.
Needs root (network, mount and PID namespaces), as the tests do."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.multinode.hosts import Cluster, Host, unavailable_reason
from tests.multinode.jobs import FAST_RDZV, Job, replicas

ROOT = Path(__file__).resolve().parents[1]
# (--rdzv-conf, a spare node's agent started beforehand): a spare waits in torch's
# rendezvous "redundancy list" while the job is full, and joins the round after a
# loss at once, instead of a replacement that boots after it.
SETTINGS = {"torch defaults": ("", False), "docs/multinode.md": (FAST_RDZV, False),
            "docs/multinode.md + a spare node": (FAST_RDZV, True)}
KILL_AT = 150
PROBE_BYTES = 64 << 20

# Tier speeds, measured from inside the hosts: a read of a /dev/shm file (the
# local tier), an HTTP GET from one host to another over the simulated link (the
# peer and store tiers: both are HTTP from another host), and torch.load of the
# same state as a rank's from /dev/shm.
_SHM_READ = r"""
import os, sys, time
path = "/dev/shm/ckptd-bench-probe"
with open(path, "wb") as f:
    f.write(os.urandom(1 << 20) * (int(sys.argv[1]) >> 20))
best = 0.0
for _ in range(3):
    start = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    best = max(best, len(data) / (time.perf_counter() - start))
os.unlink(path)
print(best)
"""
_TORCH_LOAD = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from readme_loop import GPT
model = GPT(d=int(sys.argv[1]))
optim = torch.optim.AdamW(model.parameters())
idx = torch.randint(0, 64, (8, 17))
model(idx[:, :-1], idx[:, 1:]).backward()
optim.step()
path = "/dev/shm/ckptd-bench-state.pt"
torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
best = float("inf")
for _ in range(3):
    start = time.perf_counter()
    torch.load(path, weights_only=True)
    best = min(best, time.perf_counter() - start)
import os; os.unlink(path)
print(best)
"""


def tier_speeds(server: Host, node: Host, width: int) -> dict[str, float]:
    """Bytes per second of each tier as the replacement node sees it, and the
    seconds torch.load takes for a rank's state from its /dev/shm."""
    local = float(node.sh(f"{sys.executable} -c '{_SHM_READ}' {PROBE_BYTES}", timeout=120))
    blob = server.dir / "tmp" / "probe"
    blob.write_bytes(os.urandom(1 << 20) * (PROBE_BYTES >> 20))
    http = server.run([sys.executable, "-m", "http.server", "8099", "--bind", server.address,
                       "--directory", str(blob.parent)], log="probe-http.log")
    try:
        speeds = []
        for _ in range(10):
            out = node.sh(f"curl -s -o /dev/null -w '%{{http_code}} %{{speed_download}}' "
                          f"http://{server.address}:8099/probe || true", timeout=120).split()
            if out[0] == "200":
                speeds.append(float(out[1]))
                if len(speeds) == 3:
                    break
            else:
                time.sleep(0.5)  # not listening yet
    finally:
        http.stop()
        blob.unlink()
    load = float(node.sh(f"{sys.executable} -c '{_TORCH_LOAD}' {width} "
                         f"{ROOT / 'tests' / 'e2e' / 'workers'}", timeout=300))
    return {"local": local, "peer": max(speeds), "store": max(speeds), "torch.load": load}


def one_failure(base: Path, setting: str, width: int) -> dict[str, Any]:
    """Kills a node once; the failure taken apart (seconds from the kill)."""
    with Cluster(base, cwd=ROOT) as net:
        (server,) = replicas(net)
        node1, node2 = net.add_host("node1"), net.add_host("node2")
        conf, spare = SETTINGS[setting]
        job = Job("failover", net.dir / "out", [server.url], rdzv_conf=conf,
                  worker_args=["--pause-host", "node2", "--pause-at", str(KILL_AT),
                               "--width", str(width)])
        job.start(node1)
        job.start(node2)
        if spare:
            job.wait_event("first_step", 600, count=4)
            node3 = net.add_host("node3")
            job.start(node3)
        job.wait_event("paused", 600)
        time.sleep(2.0)  # the spare's agent is in the rendezvous by now
        killed = time.time()
        node2.kill()
        if not spare:
            node3 = net.add_host("node3")
            job.start(node3)
        job.wait(900)
        speeds = tier_speeds(server.host, node3, width)
        return breakdown(job.events(), killed, speeds) | {"setting": setting}


def breakdown(events: list[dict[str, Any]], killed: float,
              speeds: dict[str, float]) -> dict[str, Any]:
    after = [e for e in events if e["t"] > killed or e.get("began", 0) > killed]

    def last(name: str) -> float:
        return float(max(e["t"] for e in after if e["event"] == name)) - killed

    failed = [e["t"] for e in after if e["event"] == "failed" and e["host"] == "node1"]
    restores = [e for e in after if e["event"] == "restored"]
    readies = {e["rank"]: e for e in after if e["event"] == "checkpointer_ready"}
    shares, floors = [], []
    for r in restores:
        ready = readies[r["rank"]]
        shares.append(r["t"] - ready["began"])
        floors.append(sum(n / speeds[tier] for tier, n in r["bytes_from"].items() if n))
    worst = max(range(len(shares)), key=lambda i: shares[i])
    bytes_from: dict[str, int] = {}
    for r in restores:
        for tier, n in r["bytes_from"].items():
            bytes_from[tier] = bytes_from.get(tier, 0) + n
    restored_step = restores[0]["step"]
    slowest = readies[restores[worst]["rank"]]
    return {
        "detection": min(failed) - killed if failed else float("nan"),
        "rendezvous": min(e["t"] for e in after if e["event"] == "started") - killed,
        "group": last("group_ready"),
        "model": last("model_ready"),
        "ckptd": last("checkpointer_ready"),
        "restored": last("restored"),
        "first step": last("first_step"),
        "redone": KILL_AT - 1 - restored_step,
        "bytes_from": bytes_from,
        "share": shares[worst],
        "construct": slowest["t"] - slowest["began"],
        "restore": restores[worst]["seconds"],
        "floor": floors[worst],
        "rank_bytes": restores[worst]["bytes"],
        "torch.load": speeds["torch.load"],
        "speeds": speeds,
    }


def machine() -> str:
    load = os.getloadavg()
    return (f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, "
            f"Linux {platform.release()}), load average {load[0]:.1f} / {load[1]:.1f} / "
            f"{load[2]:.1f}")


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| torchrun setting | detection | rendezvous | group | model | ckptd ready | "
            "restored | first step (MTTR) | steps redone | bytes local / peer / store | "
            "ckptd share | of it: construct / restore | tier floor | beyond floor | "
            "restore / torch.load |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        b = r["bytes_from"]
        lines.append(
            f"| {r['setting']} | {r['detection']:.2f} | {r['rendezvous']:.2f} | "
            f"{r['group']:.2f} | {r['model']:.2f} | {r['ckptd']:.2f} | {r['restored']:.2f} | "
            f"{r['first step']:.2f} | {r['redone']} | "
            f"{b.get('local', 0) / 1e6:.2f} / {b.get('peer', 0) / 1e6:.2f} / "
            f"{b.get('store', 0) / 1e6:.2f} MB | {r['share']:.3f} s | "
            f"{r['construct']:.3f} / {r['restore']:.3f} | {r['floor'] * 1e3:.1f} ms | "
            f"{r['share'] - r['floor']:.3f} s | {r['restore'] / r['torch.load']:.1f}x |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == setting]
        mttr = statistics.median(r["first step"] for r in mine)
        share = statistics.median(r["share"] for r in mine)
        beyond = max(r["share"] - r["floor"] for r in mine)
        out.append(f"- {setting}: MTTR (kill to first step) median {mttr:.1f} s; ckptd's "
                   f"share median {share:.2f} s ({share / mttr:.0%} of it), at most "
                   f"{beyond:.2f} s beyond its tier floor (target <= 1 s: "
                   f"{'met' if beyond <= 1.0 else 'NOT met'})")
    return "\n".join(out)


def command(argv: list[str]) -> str:
    """The command as it was run (every option given), for the report's heading."""
    return shlex.join(["python", "-m", "bench.failover", *argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="failures per setting")
    parser.add_argument("--width", type=int, default=32,
                        help="the model's width: 32 is the tests' (1.4 MB of state per "
                             "rank), 256 about 20 MB")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--json", type=Path, help="every row, raw")
    args = parser.parse_args()
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        sys.exit(f"bench.failover: no torchrun setting {', '.join(map(repr, unknown))}; "
                 f"--settings takes a comma-separated list of: {', '.join(SETTINGS)}")
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"bench.failover: {reason}")
    started = datetime.now(UTC)
    before = machine()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckptd-failover-") as scratch:
        for n in range(args.rounds):  # settings alternate from round to round
            order = args.settings.split(",")
            for setting in order[n % len(order):] + order[:n % len(order)]:
                row = one_failure(Path(scratch) / f"{n}-{len(rows)}", setting, args.width)
                rows.append(row)
                print(f"{setting}: MTTR {row['first step']:.2f} s, ckptd share "
                      f"{row['share']:.3f} s", flush=True)
    rows.sort(key=lambda r: list(SETTINGS).index(r["setting"]))
    speeds = rows[-1]["speeds"]
    text = (f"## Failover, a node lost ({started:%Y-%m-%d %H:%M} UTC, "
            f"`{command(sys.argv[1:])}`)\n\n"
            f"Machine: {before} at the start, {machine().split('load average ')[1]} at "
            f"the end.\nTiers as the replacement node measured them: /dev/shm read "
            f"{speeds['local'] / 1e9:.2f} GB/s, HTTP between hosts "
            f"{speeds['peer'] / 1e9:.2f} GB/s; torch.load of one rank's state from "
            f"/dev/shm {speeds['torch.load'] * 1e3:.1f} ms.\nSeconds from the kill:\n\n"
            f"{table(rows)}\n\n{summary(rows)}\n")
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
