"""What runs on the simulated hosts: ``ckptd serve`` replicas on hosts of their
own over one shared store directory, and a training job of one ``torchrun``
agent per node (c10d rendezvous), started with the commands docs/multinode.md
gives. The worker is workers/train.py (the README's loop); the job reads back
its events and each rank's result."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.multinode.hosts import Cluster, Host, HostError, HostProcess

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "train.py"
PORT = 8470
RDZV_PORT = 29400

# torchrun's waits, cut (docs/multinode.md says why each): a dead node's
# rendezvous entry expires after keep_alive_interval * keep_alive_max_attempt
# (5 s * 3 by default) and an elastic round waits last_call_timeout (30 s) for
# latecomers once it has its minimum.
# torch 2.13's c10d agents share their rendezvous TCPStore with the workers
# (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset): an agent writes the workers'
# MASTER_ADDR/PORT under a round's prefix only in the first round it joins, so a
# node that joins a later round (a replacement) waits for keys that are never
# written, and the survivors wait for its role_info, until the store timeout
# (dynamic_rendezvous.py, next_rendezvous). Building them in every round fixes it.
LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STEPS = 230  # the README's loop saves every 100 steps: 0, 100, 200

FAST_RDZV = ("join_timeout=300,last_call_timeout=2,close_timeout=10,"
             "keep_alive_interval=1,keep_alive_max_attempt=3")


def tool(name: str) -> str:
    """A console script of this environment (``ckptd``, ``torchrun``)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise HostError(f"{name} is not installed beside {sys.executable}")
    return str(path)


def base_env(**extra: str) -> dict[str, str]:
    """This environment without the user's ckptd settings, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def http(host: Host, method: str, url: str, timeout: float = 10.0, **kwargs: Any) -> Any:
    """One request made from ``host``'s network; the decoded JSON body."""
    def call() -> Any:
        response = httpx.request(method, url, timeout=timeout, **kwargs)
        response.raise_for_status()
        return response.json()
    return host.call(call, timeout=timeout + 5)


def wait_until(what: str, check: Callable[[], Any], timeout: float,
               interval: float = 0.2) -> Any:
    """``check()``'s first truthy value; fails after ``timeout`` saying ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


PEER_SECRET = "multinode-peer-secret"


class Replica:
    """``ckptd serve`` on a host of its own, over the cluster's shared store."""

    def __init__(self, host: Host, store: Path, members: Sequence[str],
                 args: Sequence[str] = ()) -> None:
        self.host = host
        self.store = store
        self.members = list(members)
        self.args = list(args)
        self.proc: HostProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.name}:{PORT}"

    def command(self) -> list[str]:
        peers = ["--peers", ",".join(self.members), "--advertise-url", self.url] \
            if len(self.members) > 1 else []
        return [tool("ckptd"), "serve", "--store", str(self.store), "--host", "0.0.0.0",
                "--port", str(PORT), *peers, *self.args]

    def env(self) -> dict[str, str]:
        """Its environment: one peer secret for every replica of a cluster, as
        docs/multinode.md sets it (each would make the peer tokens its own way)."""
        return {**base_env(), **({"CKPTD_PEER_SECRET": PEER_SECRET}
                                 if len(self.members) > 1 else {})}

    def start(self, timeout: float = 90.0) -> Replica:
        self.proc = self.host.run(self.command(), env=self.env(), log="ckptd-serve.log")
        healthz = f"http://{self.host.address}:{PORT}/healthz"

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise HostError(f"ckptd serve on {self.host.name} exited:\n{self.proc.log()}")
            try:
                return bool(http(self.host, "GET", healthz, timeout=2.0))
            except (httpx.HTTPError, OSError):
                return False

        wait_until(f"ckptd serve on {self.host.name} answering", answers, timeout)
        return self

    def get(self, path: str, via: Host | None = None) -> Any:
        return http(via or self.host, "GET", f"http://{self.host.address}:{PORT}{path}")


class Job:
    """One training job: a ``torchrun`` agent per node, all with one command."""

    def __init__(self, name: str, out: Path, urls: Sequence[str], *, nnodes: str = "2",
                 nproc: int = 2, endpoint: str = "node1", max_restarts: int = 3,
                 rdzv_conf: str = FAST_RDZV, worker_args: Sequence[str] = (),
                 steps: int = STEPS, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.urls = list(urls)
        self.nnodes, self.nproc, self.endpoint = nnodes, nproc, endpoint
        self.max_restarts = max_restarts
        self.rdzv_conf = rdzv_conf
        self.worker_args = list(worker_args)
        self.steps = steps
        self.extra_env = dict(env or {})
        self.agents: dict[str, HostProcess] = {}

    def command(self) -> list[str]:
        """The command every node runs (docs/multinode.md)."""
        conf = [f"--rdzv-conf={self.rdzv_conf}"] if self.rdzv_conf else []
        return [tool("torchrun"), f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}",
                f"--max-restarts={self.max_restarts}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}:{RDZV_PORT}", f"--rdzv-id={self.name}",
                *conf, str(WORKER), str(self.out), "--steps", str(self.steps),
                *self.worker_args]

    def env(self) -> dict[str, str]:
        return base_env(**LAUNCH_ENV, CKPTD_URL=",".join(self.urls),
                        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "e2e" / "workers"),
                                                    os.environ.get("PYTHONPATH", "")]),
                        **self.extra_env)

    def start(self, host: Host) -> HostProcess:
        agent = host.run(self.command(), env=self.env(), log=f"torchrun-{self.name}.log")
        self.agents[host.name] = agent
        return agent

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        found = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if (event is None or record["event"] == event) and all(
                    record.get(k) == v for k, v in match.items()):
                found.append(record)
        return found

    def wait_event(self, event: str, timeout: float, count: int = 1,
                   **match: Any) -> list[dict[str, Any]]:
        def seen() -> list[dict[str, Any]] | None:
            self.check_agents()
            found = self.events(event, **match)
            return found if len(found) >= count else None
        found: list[dict[str, Any]] = wait_until(
            f"{self.name}: {count} x {event} {match or ''}{self.tail()}", seen, timeout)
        return found

    def check_agents(self) -> None:
        """Fails at once when a live host's agent exited with an error."""
        for name, agent in self.agents.items():
            code = agent.poll()
            if code not in (None, 0) and not agent.host.dead:
                raise AssertionError(f"{self.name}: the agent on {name} exited {code}:\n"
                                     f"{agent.log()[-6000:]}")

    def tail(self, chars: int = 3000) -> str:
        return "".join(f"\n--- {n} ---\n{a.log()[-chars:]}" for n, a in self.agents.items())

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Waits for the live hosts' agents to finish; every rank's result."""
        deadline = time.monotonic() + timeout
        for name, agent in self.agents.items():
            if agent.host.dead:
                continue
            code = agent.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise AssertionError(f"{self.name}: the agent on {name} exited {code}:"
                                     f"{self.tail(8000)}")
        world = len(list(self.out.glob("rank*.json")))
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(world)]

    def release(self) -> None:
        """Lets a paused rank go on (workers/train.py --pause-*)."""
        (self.out / "go-on").write_text("")


def replicas(cluster: Cluster, count: int = 1, args: Sequence[str] = (),
             store: Path | None = None) -> list[Replica]:
    """``count`` replicas on hosts ckptd-a, ckptd-b... over one store directory
    (a fresh one unless given)."""
    store = store or cluster.dir / "store"
    hosts = [cluster.add_host(f"ckptd-{chr(ord('a') + i)}") for i in range(count)]
    urls = [f"http://{h.name}:{PORT}" for h in hosts]
    started = [Replica(h, store, urls, args) for h in hosts]
    for replica in started:
        replica.start()
    return started
