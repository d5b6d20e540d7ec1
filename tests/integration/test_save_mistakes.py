"""A caller's mistake in ``save()`` is refused by ``save()`` itself, typed
(``InvalidRequest``) with what to do, before anything is staged or uploaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer
from ckptd.errors import InvalidRequest
from ckptd.lifecycle.tags import read_tags
from ckptd.store import LocalStore

pytestmark = pytest.mark.timeout(120)


def open_ckpt(tmp_path: Path, shm: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(f"file://{tmp_path / 'store'}", job="j", shm_dir=shm,
                        on_error="raise", **kw)


@pytest.mark.parametrize("how", ["tag", "meta"])
def test_a_malformed_tag_is_refused_before_the_upload(
    tmp_path: Path, shm: Path, how: str
) -> None:
    state = {"w": torch.arange(10.0)}
    bad: dict[str, Any] = (
        {"tag": "best model!"} if how == "tag" else {"meta": {"tag": "best model!"}}
    )
    with open_ckpt(tmp_path, shm) as ckpt:
        with pytest.raises(InvalidRequest, match="letters, digits"):
            ckpt.save(3, state, **bad)
        assert ckpt.latest() is None  # nothing was uploaded, nothing failed behind
        # The loop fixes the tag and the same step commits, tagged.
        assert ckpt.save(3, state, tag="best-model").wait(30).state == "committed"
        assert ckpt.close().failed == 0
    tags = asyncio.run(read_tags(LocalStore(tmp_path / "store"), "j"))
    assert tags == {"best-model": 3}
