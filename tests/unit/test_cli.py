"""The ckptd command line, run in process (commands that need no server)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ckptd.cli import app

runner = CliRunner()


def test_policy_check_refuses_a_malformed_file_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "policy.toml"
    bad.write_text("[probe]\ninterval_s = 5\n\n[signals.gpu_temperature_c]\ndegraded = 99\n"
                   "critical = 90\n")
    result = runner.invoke(app, ["policy", "check", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:5:" in result.output
    assert "above critical" in result.output


def test_policy_check_prints_the_effective_policy(tmp_path: Path) -> None:
    good = tmp_path / "policy.toml"
    good.write_text("[signals.gpu_temperature_c]\ndegraded = 80\n")
    result = runner.invoke(app, ["policy", "check", str(good)])
    assert result.exit_code == 0, result.output
    assert "[signals.gpu_temperature_c]" in result.output
    assert "degraded = 80" in result.output
    assert "nonfinite_loss" in result.output  # defaults merged in


def test_policy_check_of_a_missing_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["policy", "check", str(tmp_path / "none.toml")])
    assert result.exit_code == 2


def test_ls_and_verify_over_a_store_directory(tmp_path: Path) -> None:
    import torch

    from ckptd.client import Checkpointer

    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, job="cli") as ckpt:
        ckpt.save(3, {"w": torch.arange(4096.0)}).wait(timeout=60)
    listing = runner.invoke(app, ["ls", "--url", url])
    assert listing.exit_code == 0 and "cli" in listing.output
    steps = runner.invoke(app, ["ls", "cli", "--url", url])
    assert steps.exit_code == 0 and "committed" in steps.output
    ok = runner.invoke(app, ["verify", "cli", "--url", url])
    assert ok.exit_code == 0 and "ok" in ok.output
    chunk = next(p for p in (tmp_path / "store" / "chunks").rglob("*") if p.is_file())
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))
    bad = runner.invoke(app, ["verify", "cli", "--url", url])
    assert bad.exit_code == 1
    assert chunk.name in bad.output


def test_restore_prefetches_a_rank_into_a_directory_store(tmp_path: Path) -> None:
    import torch

    from ckptd.client import Checkpointer

    url = f"file://{tmp_path / 'store'}"
    state = {"w": torch.randn(300, 300), "step": 4}
    with Checkpointer(url, job="pre", chunk_size=64 * 1024) as ckpt:
        ckpt.save(4, state).wait(timeout=60)
    target = tmp_path / "node-cache"
    result = runner.invoke(
        app, ["restore", "--job", "pre", "--rank", "0", "--to", str(target), "--url", url,
              "--no-peers"]
    )
    assert result.exit_code == 0, result.output
    assert "step 4" in result.output
    # The directory is a store of its own now: a restore reads it with no other source.
    with Checkpointer(f"file://{target}", job="pre") as local:
        restored: dict[str, object] = {}
        local.restore(restored)
    assert torch.equal(restored["w"], state["w"])  # type: ignore[arg-type]
    assert restored["step"] == 4
