"""torch's low-precision training dtypes: float8_e4m3fnuz, float8_e5m2fnuz, the MX
block scales float8_e8m0fnu and packed fp4 float4_e2m1fn_x2. A save holding one was
refused ("tensors of dtype torch.float8_e8m0fnu cannot be checkpointed"): a user
training with MXFP8 could not checkpoint at all. Each now saves and restores
bitwise (every bit pattern) from every tier: a crashed worker's pool, peers, the
store through a real server; into fresh tensors and into a target of its dtype;
a target of another dtype is refused naming both, as for any dtype."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_client_common import assert_bitwise

from ckptd.client import Checkpointer
from ckptd.client.dtypes import byte_view
from ckptd.errors import RestoreError
from ckptd.hashing import chunk_id, chunk_spans
from tests.conftest import ServerProcess
from tests.integration.peer_fixtures import exported_shm, peer_server  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).parent))
from restore_peer import (  # noqa: E402
    CHUNK,
    TOKEN,
    low_precision_tensors,
    make_state,
    spawn,
    wait_held,
    wait_ready,
)

pytestmark = pytest.mark.timeout(180)

NBYTES = 1 << 16


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _distinct_bytes(state: Any) -> int:
    sizes = {}
    for t in _tensors(state):
        view = byte_view(t.contiguous())
        for a, b in chunk_spans(len(view), CHUNK):
            sizes[chunk_id(view[a:b])] = b - a
    return sum(sizes.values())


def _zeros_like(state: Any) -> Any:
    """The state's structure with its tensors zeroed, of the same dtypes and shapes."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=torch.uint8).view(state.dtype) \
            if state.element_size() == 1 else torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return state


def test_a_crashed_workers_pool_gives_them_back_bitwise(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    proc = spawn(url, "lp-crash", 0, 1, 5, seed=1, nbytes=NBYTES, stage_only=True,
                 low_precision=True)
    assert proc.wait(60) == -signal.SIGKILL, proc.stdout.read() if proc.stdout else ""
    expected = make_state(1, NBYTES, low_precision=True)
    target = _zeros_like(expected)
    held = {name: t.data_ptr() for name, t in target["lowp"].items()}
    with Checkpointer(url, "lp-crash", chunk_size=CHUNK) as ckpt:
        result = ckpt.restore(target)
    assert_bitwise(target, expected)
    # Restored into the target's own tensors, of its dtype, in place:
    assert {name: t.data_ptr() for name, t in target["lowp"].items()} == held
    assert result.problems == []
    assert result.bytes_from.get("local") == _distinct_bytes(expected)
    assert result.bytes_from.get("store", 0) == 0


def test_a_lost_node_restores_them_from_its_peers(srv: ServerProcess, shm: Path) -> None:
    expected = make_state(5, NBYTES, low_precision=True)
    procs = [spawn(srv.url, "lp-peers", r, 3, 7, seed=5, nbytes=NBYTES, low_precision=True)
             for r in (0, 1)]
    try:
        with Checkpointer(srv.url, "lp-peers", rank=2, world_size=3, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:
            ckpt.save(7, expected).wait(timeout=60)
        for p in procs:
            wait_ready(p)
        wait_held(srv, "lp-peers", [0, 1], 7)
        got: dict[str, Any] = {}
        with Checkpointer(srv.url, "lp-peers", rank=2, world_size=3, token=TOKEN,
                          chunk_size=CHUNK) as ckpt:  # a new node: its pool is gone
            result = ckpt.restore(got)
        assert_bitwise(got, expected)
        assert result.bytes_from["peer"] == _distinct_bytes(expected)
        assert result.bytes_from.get("store", 0) == 0 and result.problems == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_store_gives_them_back_through_a_server(srv: ServerProcess, shm: Path) -> None:
    expected = low_precision_tensors(9)
    state = {"w": torch.randn(300), "lowp": expected,
             "scalar": torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
    with Checkpointer(srv.url, "lp-store", token=TOKEN, chunk_size=CHUNK,
                      serve_peers=False) as ckpt:
        assert ckpt.save(3, state).wait(timeout=60).state == "committed"
    with Checkpointer(srv.url, "lp-store", token=TOKEN, chunk_size=CHUNK,
                      serve_peers=False) as ckpt:  # a new process: no pool, no peers
        fresh: dict[str, Any] = {}
        result = ckpt.restore(fresh)
        assert_bitwise(fresh, state)
        assert result.bytes_from.get("store") == _distinct_bytes(state)
        target = _zeros_like(state)
        ckpt.restore(target)
        assert_bitwise(target, state)
        # A target of another dtype is refused naming it, as for any other dtype.
        wrong = _zeros_like(state)
        wrong["lowp"]["float8_e8m0fnu"] = wrong["lowp"]["float8_e8m0fnu"].view(
            torch.float8_e4m3fnuz)
        wrong["lowp"]["float4_e2m1fn_x2"] = wrong["lowp"]["float4_e2m1fn_x2"].view(
            torch.uint8)
        with pytest.raises(RestoreError) as info:
            ckpt.restore(wrong)
    said = str(info.value)
    shape = list(expected["float8_e8m0fnu"].shape)
    assert said.startswith("2 tensors in the target differ from the checkpoint"), said
    assert f"'lowp.float8_e8m0fnu': target torch.float8_e4m3fnuz{shape}, checkpoint " \
        f"torch.float8_e8m0fnu{shape}" in said, said
    assert f"'lowp.float4_e2m1fn_x2': target torch.uint8{shape}, checkpoint " \
        f"torch.float4_e2m1fn_x2{shape}" in said, said
    assert "\n" not in said
