"""DCP's ``Reader`` against a real ``ckptd serve``: its metadata of a step saved by
several ranks is one request (the server's step plan), its chunks come through the
restore engine's tiers (live peers here), and loads are bitwise, whether a chunk
lands straight in its target tensor or goes through fresh memory. A Checkpointer's
elastic restore reads the same step plan."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_client_common import assert_bitwise

from ckptd.client import Checkpointer, Shard
from ckptd.client.dcp import Reader
from ckptd.client.dcp import reader as dcp_reader
from tests.conftest import ServerProcess
from tests.integration.peer_fixtures import exported_shm, peer_server  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).parent))
import test_restore_tiers as tiers  # noqa: E402
from restore_peer import (  # noqa: E402
    CHUNK,
    TOKEN,
    make_state,
    spawn,
    wait_held,
    wait_ready,
)

pytestmark = pytest.mark.timeout(180)

_REQUEST = re.compile(r'"(GET|HEAD|POST|PUT|DELETE) (/v1/\S+) HTTP/1\.1"')


def requests_in_log(server: ServerProcess) -> list[str]:
    """The API requests the server's access log shows (heartbeats left out: the
    peers send them all along)."""
    return [f"{m[1]} {m[2]}" for m in _REQUEST.finditer(server.log())
            if not m[2].endswith("/heartbeat")]


def test_metadata_of_a_three_rank_step_is_one_request_and_chunks_come_from_peers(
    srv: ServerProcess, shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = make_state(3, 1 << 20)
    procs = [spawn(srv.url, "dcp-peers", r, 3, 4, seed=3, nbytes=1 << 20) for r in (1, 2)]
    try:
        with Checkpointer(srv.url, "dcp-peers", rank=0, world_size=3, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:
            ckpt.save(4, expected).wait(timeout=60)
        for p in procs:
            wait_ready(p)
        wait_held(srv, "dcp-peers", [1, 2], 4)
        # A new node: rank 0's pool is not here, its replicas' pools are.
        monkeypatch.setenv("CKPTD_SHM_DIR", str(tmp_path / "empty-shm"))
        reader = Reader(srv.url, "dcp-peers", token=TOKEN)
        before = requests_in_log(srv)
        reader.read_metadata()
        # (The session's look at the cluster, made in the background when it opens,
        # may land in this window on a loaded machine: it is routing, not metadata.)
        asked = [r for r in requests_in_log(srv)[len(before):]
                 if not r.startswith("GET /v1/cluster")]
        # Not a request per rank (latest, commit, each manifest, each rank's plan).
        assert len(asked) == 1 and asked[0].startswith("GET /v1/jobs/dcp-peers/step-plan?"), asked
        target = tiers.target_like(expected)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's no_dist warning
            dcp.load(target, storage_reader=reader, no_dist=True)
        assert_bitwise(target, expected)
        # Every chunk from the two live replicas, none from the store.
        assert reader.bytes_from["peer"] == reader.bytes_read > 0
        assert reader.bytes_from.get("store", 0) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("transport", "batch_chunks"), [("file", None), ("http", None),
                                                        ("file", 3)])
def test_a_sharded_step_loads_bitwise_into_every_kind_of_target(
    transport: str, batch_chunks: int | None, tmp_path: Path, shm: Path,
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rows of a contiguous target are its own bytes (chunks land in it); columns,
    # a transposed target and another dtype go through fresh memory and a copy.
    # With batches of 3 chunks, each batch is delivered (and its maps released)
    # before the next starts.
    if batch_chunks is not None:
        monkeypatch.setattr(dcp_reader, "BATCH_CHUNKS", batch_chunks)
    if transport == "http":
        server = request.getfixturevalue("srv")
        url, token = server.url, TOKEN
    else:
        url, token = f"file://{tmp_path / 'store'}", None
    g = torch.Generator().manual_seed(7)
    full = {"rows": torch.randn(96, 40, generator=g), "cols": torch.randn(24, 60, generator=g),
            "half": torch.randn(50, 30, generator=g).to(torch.bfloat16)}
    for r in range(2):
        state, shards = {}, {}
        for name, t in full.items():
            dim = 1 if name == "cols" else 0
            n = t.shape[dim]
            a, b = n * r // 2, n * (r + 1) // 2
            state[name] = t.narrow(dim, a, b - a).contiguous().clone()
            offsets = [0, 0]
            offsets[dim] = a
            shards[name] = Shard(list(t.shape), offsets)
        with Checkpointer(url, "dcp-sharded", rank=r, world_size=2, token=token,
                          chunk_size=4097) as ckpt:  # cuts elements in two
            ckpt.save(1, state, shards=shards).wait(timeout=60)
    transposed = torch.zeros(30, 50, dtype=torch.bfloat16).t()  # not contiguous
    target = {"rows": torch.zeros(96, 40), "cols": torch.zeros(24, 60), "half": transposed}
    reader = Reader(url, "dcp-sharded", token=token)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert_bitwise(target["rows"], full["rows"])
    assert_bitwise(target["cols"], full["cols"])
    assert torch.equal(target["half"].contiguous().view(torch.int16),
                       full["half"].view(torch.int16))
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in full.values())


def test_an_elastic_restore_reads_every_manifest_in_one_step_plan(
    srv: ServerProcess, shm: Path
) -> None:
    """A Checkpointer restoring a 4-rank step into 2 ranks needs every rank's
    manifest and holders: one step plan, not a restore plan (or a manifest read)
    per saving rank."""
    full = tiers.global_state(5)
    for r in range(4):
        state, shards = tiers.shard_of(full, r, 4)
        with Checkpointer(srv.url, "elastic-plan", rank=r, world_size=4, token=TOKEN,
                          chunk_size=4096) as ckpt:
            ckpt.save(2, state, shards=shards, local=["rng"]).wait(timeout=60)
    expected, shards = tiers.shard_of(full, 1, 2)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
              for k, v in expected.items()}
    with Checkpointer(srv.url, "elastic-plan", rank=1, world_size=2, token=TOKEN) as ckpt:
        before = requests_in_log(srv)
        result = ckpt.restore(target, shards=shards)
        asked = [a for a in requests_in_log(srv)[len(before):] if "/chunks/" not in a]
    assert result.elastic
    for name in ("rows", "cols", "cube", "bias"):
        assert_bitwise(target[name], expected[name], name)
    plans = [a for a in asked if "/restore-plan" in a or "/step-plan" in a]
    manifests = [a for a in asked if re.search(r"/ranks/\d+(\?|$)", a.split(" ")[1])]
    assert len(plans) == 2 and any("/step-plan" in a for a in plans), asked
    assert manifests == [], asked
