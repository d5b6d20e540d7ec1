"""``ckptd restore --to`` shows a progress bar with bytes and the transfer rate."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console


def test_restore_to_shows_bytes_and_rate(tmp_path: Path) -> None:
    import torch

    from ckptd.client import Checkpointer
    from ckptd.client.restore.prefetch import restore_command

    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, job="pre", chunk_size=64 * 1024, shm_dir=tmp_path / "shm") as ckpt:
        ckpt.save(4, {"w": torch.randn(300, 300)}).wait(timeout=60)
    console = Console(force_terminal=True, record=True, width=120, color_system=None)
    result = restore_command(url, "pre", 0, str(tmp_path / "to"), peers=False, console=console)
    text = console.export_text()
    assert result.bytes == 300 * 300 * 4
    assert "pre step 4 rank 0" in text, text
    assert re.search(r"360\.0/360\.0 kB", text), text  # bytes done / total
    assert re.search(r"[\d.]+ [kMG]?B/s", text), text  # the rate
