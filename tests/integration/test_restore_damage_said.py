"""A restore that cannot produce the latest step says which step, why, and what to
do: a damaged chunk names the step, the cause and the way out (an earlier step, or
``ckptd scrub``); a damaged latest step skipped for an older one is said on the
command line; the progress bar of a failed ``ckptd restore --to`` never ends full."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from ckptd.cli import app
from ckptd.client import Checkpointer
from ckptd.client.restore.prefetch import restore_command
from ckptd.errors import RestoreError
from ckptd.hashing import chunk_id, chunk_spans

pytestmark = pytest.mark.timeout(120)

CHUNK = 64 * 1024
runner = CliRunner()


def saved(tmp_path: Path, job: str, steps: int) -> tuple[str, dict[str, torch.Tensor]]:
    """A file:// store holding ``steps`` steps of ``job`` (1..steps), each its own bytes."""
    url = f"file://{tmp_path / 'store'}"
    state: dict[str, torch.Tensor] = {}
    with Checkpointer(url, job, chunk_size=CHUNK, shm_dir=tmp_path / "shm") as ckpt:
        for step in range(1, steps + 1):
            state = {"w": torch.arange(90000, dtype=torch.float32) * step}
            ckpt.save(step, state).wait(timeout=60)
    return url, state


def chunk_file(tmp_path: Path, t: torch.Tensor, index: int) -> Path:
    data = t.numpy().tobytes()
    a, b = list(chunk_spans(len(data), CHUNK))[index]
    cid = chunk_id(data[a:b])
    return tmp_path / "store" / "chunks" / cid[:2] / cid


def test_a_truncated_chunk_names_the_step_the_cause_and_the_way_out(tmp_path: Path) -> None:
    url, latest = saved(tmp_path, "d4", 3)
    victim = chunk_file(tmp_path, latest["w"], 1)
    victim.write_bytes(victim.read_bytes()[:1000])

    with Checkpointer(url, "d4", shm_dir=tmp_path / "shm") as ckpt, \
            pytest.raises(RestoreError) as info:
        ckpt.restore({"w": torch.zeros(90000)})
    text = str(info.value)
    assert info.value.detail["ids"] == [victim.name] and info.value.detail["step"] == 3
    assert "step 3" in text and "wrong size" in text and "1000 bytes" in text, text
    assert "earlier step" in text and "ckptd scrub" in text, text

    result = runner.invoke(app, ["restore", "--job", "d4", "--rank", "0", "--to",
                                 str(tmp_path / "to"), "--url", url, "--no-peers"])
    assert result.exit_code == 1, result.output  # (damage found: docs/operations.md)
    flat = " ".join(result.output.split())
    assert "[restore_failed]" in flat and "step 3" in flat and "wrong size" in flat, flat
    assert "--step" in flat and "ckptd scrub" in flat, flat

    # What the message says works: scrub marks step 3, and a restore of latest skips
    # it, saying so.
    scrubbed = runner.invoke(app, ["scrub", "--url", url])
    assert scrubbed.exit_code == 1 and "damaged d4 steps [3]" in scrubbed.output, scrubbed.output
    result = runner.invoke(app, ["restore", "--job", "d4", "--rank", "0", "--to",
                                 str(tmp_path / "to"), "--url", url, "--no-peers"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "ok: step 2 of d4" in flat, flat
    assert re.search(r"latest skipped: restored step 2.*step 3 of d4 is marked damaged", flat)


def test_a_damaged_latest_step_skipped_by_the_command_line_is_said(tmp_path: Path) -> None:
    url, _ = saved(tmp_path, "d1", 3)
    manifest = tmp_path / "store" / "jobs" / "d1" / "steps" / "3" / "ranks" / "0.json"
    manifest.write_bytes(manifest.read_bytes()[:50])

    done = restore_command(url, "d1", 0, tmp_path / "to", peers=False, progress=False)
    assert done.step == 2
    assert [(p.kind, p.source) for p in done.problems] == [("damaged", "latest")]
    assert "jobs/d1/steps/3/ranks/0.json" in done.problems[0].message

    result = runner.invoke(app, ["restore", "--job", "d1", "--rank", "0", "--to",
                                 str(tmp_path / "to2"), "--url", url, "--no-peers"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "ok: step 2 of d1" in flat, flat
    assert "latest skipped: restored step 2" in flat and "steps/3/ranks/0.json" in flat, flat


def test_the_progress_bar_of_a_failed_restore_does_not_end_full(tmp_path: Path) -> None:
    url, latest = saved(tmp_path, "bar", 1)
    chunk_file(tmp_path, latest["w"], 2).unlink()
    console = Console(force_terminal=True, record=True, width=160, color_system=None)
    with pytest.raises(RestoreError):
        restore_command(url, "bar", 0, tmp_path / "to", peers=False, console=console)
    text = console.export_text()
    assert "360.0/360.0 kB" not in text, text
    assert re.search(r"294\.5/360\.0 kB", text), text  # the verified bytes only
    assert "failed: 1 chunks" in text, text


def test_an_export_of_latest_that_falls_back_says_so(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """(Found by a probe.) With latest damaged, ``ckptd export`` read the step before
    it and said only "ok: step 2": it read ``latest`` (the ref), not the newest
    usable step with its problems."""
    from ckptd.client.integrations.safetensors import export_safetensors

    url, _ = saved(tmp_path, "d2", 3)
    manifest = tmp_path / "store" / "jobs" / "d2" / "steps" / "3" / "ranks" / "0.json"
    manifest.write_bytes(manifest.read_bytes()[:50])
    with caplog.at_level("WARNING", logger="ckptd.client.transport"):
        export_safetensors(url, "d2", tmp_path / "out")
    said = [r.getMessage() for r in caplog.records if r.name == "ckptd.client.transport"]
    assert any("reading step 2, the newest usable one" in m and "steps/3/ranks/0.json" in m
               for m in said), said
