"""``ckptd export --safetensors`` of steps that 4 torchrun ranks saved (gloo, CPU,
a real server): DTensors of every layout through a Checkpointer, a ShardedTensor
with two shards per rank through DCP. Every global tensor comes out whole and
bitwise, read by safetensors where ckptd is not importable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckptd.cli import app
from tests.integration.test_safetensors_export import fingerprint, read_without_ckptd

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def test_steps_of_four_ranks_export_whole_and_bitwise(server: Any, torchrun: Any,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = torchrun("safetensors_steps.py", 4, server.url, "ranks", out=out, timeout=240)
    assert "committed" in [r["saved"] for r in results]  # (the last rank in commits)
    for step in (1, 2):
        target = tmp_path / f"export{step}"
        done = CliRunner().invoke(app, ["export", "ranks", str(step), "--safetensors",
                                        str(target), "--max-shard-size", "1KB",
                                        "--url", server.url])
        assert done.exit_code == 0, done.output
        expected = torch.load(out / f"step{step}.pt", weights_only=True)
        seen = read_without_ckptd(target, tmp_path)["tensors"]
        assert seen == {name: fingerprint(t) for name, t in expected.items()}, step
