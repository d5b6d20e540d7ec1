"""torchft's ``Manager`` heals through ``CkptdTransport``: a lighthouse and two
replica groups (one rank each, gloo on the CPU, run as threads the way torchft's
own integration tests run them). Group A trains alone; group B joins late with
other weights, is healed from A's staging pool and ends bitwise equal to A. With
a flipped byte in A's pool, B's first heal fails with ``ChunkHashMismatch``, the
step does not commit on B and nothing is loaded; the next quorum heals it."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import ChunkHashMismatch

# CI installs the extras (pyproject's test extra): a missing one fails there, not skips.
if not os.environ.get("CI"):
    pytest.importorskip("torchft", reason="pip install 'ckptd[torchft]'")

from torch.distributed import TCPStore  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from ckptd.client.integrations.torchft import CkptdTransport  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Collectives and heals time out well before a quorum does: after a failed heal the
# healthy group waits out its allreduce with the group that failed, then both meet
# in a new quorum (torchft's own recovery), which must not time out meanwhile.
T = timedelta(seconds=5)
QUORUM_T = timedelta(seconds=60)
STEPS = 8  # each group's last step
JOIN_AT = 3  # group B starts once A has committed this many steps


def _digest(state: Any) -> str:
    """A digest of a state's tensors (bytes and names), in order."""
    h = hashlib.blake2b()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(path.encode())
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}")

    walk(state, "")
    return h.hexdigest()


class Recorded(CkptdTransport[Any]):
    """Records what it sent (a digest per step), what each receive ended in, and
    flips one byte of a served chunk for the first ``corrupt`` sends."""

    def __init__(self, *args: Any, corrupt: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupt = corrupt
        self.corrupted = 0
        self.sent: dict[int, str] = {}
        self.received: list[str] = []  # "ok" or the error's type

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        self.sent[step] = _digest(state_dict["user"]["default"])
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)
        if self.corrupted < self.corrupt:
            manifest = self._server.manifest
            assert manifest is not None
            cid = next(c for c in self._server.index.chunks if c != manifest[0])
            self._server.index.chunks[cid][0] ^= 0x10
            self.corrupted += 1

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        try:
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        except Exception as exc:
            self.received.append(type(exc).__name__)
            raise
        self.received.append("ok")
        return state


@pytest.fixture
def lighthouse(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        yield "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    finally:
        server.shutdown()


def _replica(rid: int, lighthouse: str, transport: Recorded, start: threading.Event,
             joined: threading.Event | None, ready: threading.Event,
             loads: list[str]) -> dict[str, Any]:
    """One replica group of one rank: trains to STEPS, healing when it is behind.
    The first group lets the second start once it is JOIN_AT steps ahead (``joined``)
    and waits until the second's manager is up (``ready``), so that they meet."""
    start.wait(60)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(rid)  # B starts with other weights than A
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        loads.append(_digest(state))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=T), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        replica_id=f"group{rid}", hostname="127.0.0.1", timeout=T,
        connect_timeout=QUORUM_T, quorum_timeout=QUORUM_T, checkpoint_transport=transport,
    )
    errors: list[str] = []
    if joined is None:
        ready.set()
    try:
        inputs = torch.linspace(-1, 1, 4 * 64).reshape(4, 64)
        while manager.current_step() < STEPS:
            manager.start_quorum()
            opt.zero_grad()
            model(inputs).square().mean().backward()
            for p in model.parameters():
                assert p.grad is not None
                manager.allreduce(p.grad).wait()
            if manager.should_commit():
                opt.step()
            elif manager.errored() is not None:
                errors.append(type(manager.errored().original_exception).__name__)
            if joined is not None and manager.current_step() >= JOIN_AT and not joined.is_set():
                joined.set()  # let the other group join now
                assert ready.wait(60), "the second group never started"
        return {"state": {k: v.clone() for k, v in model.state_dict().items()},
                "optim": _digest(opt.state_dict()), "errors": errors}
    finally:
        manager.shutdown(wait=False)


def _run(lighthouse: str, shm: Path, corrupt: int) -> tuple[dict[str, Any], ...]:
    a_transport = Recorded(T, corrupt=corrupt, shm_dir=str(shm), chunk_size=64 * 1024)
    b_transport = Recorded(T, shm_dir=str(shm), chunk_size=64 * 1024)
    go, a_ahead, b_up = threading.Event(), threading.Event(), threading.Event()
    go.set()
    a_loads: list[str] = []
    b_loads: list[str] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(_replica, 0, lighthouse, a_transport, go, a_ahead, b_up, a_loads)
            b = pool.submit(_replica, 1, lighthouse, b_transport, a_ahead, None, b_up, b_loads)
            ra, rb = a.result(timeout=150), b.result(timeout=150)
    finally:
        a_transport.shutdown()
        b_transport.shutdown()
    return ra, rb, {"a": a_transport, "b": b_transport, "a_loads": a_loads,
                    "b_loads": b_loads}


def test_a_late_group_heals_through_ckptd_and_ends_bitwise(lighthouse: str, shm: Path) -> None:
    a, b, seen = _run(lighthouse, shm, corrupt=0)
    assert seen["a"].stats.sends >= 1 and seen["b"].received[:1] == ["ok"]
    assert seen["b"].stats.chunks_verified > 4
    # What B loaded is what A sent at that step: nothing else reached B's model.
    assert seen["b_loads"] and set(seen["b_loads"]) <= set(seen["a"].sent.values())
    assert a["errors"] == b["errors"] == []
    for name, t in a["state"].items():
        assert torch.equal(t.view(torch.uint8), b["state"][name].view(torch.uint8)), name
    assert a["optim"] == b["optim"]


def test_a_bad_chunk_fails_the_heal_and_the_next_one_heals(lighthouse: str, shm: Path) -> None:
    a, b, seen = _run(lighthouse, shm, corrupt=1)
    assert seen["a"].corrupted == 1
    # The first heal failed typed, the step did not commit on B, and it loaded nothing.
    assert seen["b"].received[0] == "ChunkHashMismatch", seen["b"].received
    assert ChunkHashMismatch.__name__ in b["errors"]
    assert seen["b"].received.count("ok") == len(seen["b_loads"]) >= 1
    assert set(seen["b_loads"]) <= set(seen["a"].sent.values())
    for name, t in a["state"].items():
        assert torch.equal(t.view(torch.uint8), b["state"][name].view(torch.uint8)), name
    assert a["optim"] == b["optim"]
