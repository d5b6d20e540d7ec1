"""PyTorch DCP's own scenarios (DTensor resharding across placements and meshes,
FSDP2 and HSDP through get_state_dict/set_state_dict, a DDP train state with a BytesIO
item) on ckptd's Writer and Reader: 4 torchrun ranks, gloo on the CPU, a real
server. Written for ckptd after PyTorch's test/distributed/checkpoint tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


def test_dcp_scenarios_on_four_ranks(server: Any, torchrun: Any, tmp_path: Path) -> None:
    results = torchrun("dcp_conformance.py", 4, server.url, out=tmp_path / "out",
                       timeout=360)
    for rank, r in enumerate(results):
        failed = sorted(name for name, ok in r.items() if not ok)
        assert not failed, (rank, failed)
    names = set(results[0])
    assert sum(n.startswith(("1d", "2d", "mesh")) for n in names) == 2 + 12 + 8 + 8
    assert {"fsdp2 ModelState dcp.save/load", "fsdp2 ModelState Checkpointer",
            "hsdp ModelState dcp.save/load", "hsdp ModelState Checkpointer",
            "ddp train_state BytesIO"} <= names
