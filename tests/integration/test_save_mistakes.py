"""A caller's mistake in ``save()`` is refused by ``save()`` itself, typed
(``InvalidRequest``) with what to do, before anything is staged or uploaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import Checkpointer, Shard
from ckptd.errors import InvalidRequest
from ckptd.lifecycle.tags import read_tags
from ckptd.store import LocalStore

pytestmark = pytest.mark.timeout(120)


def open_ckpt(tmp_path: Path, shm: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(f"file://{tmp_path / 'store'}", job="j", shm_dir=shm,
                        on_error="raise", **kw)


@pytest.mark.parametrize(("how", "name", "said"), [
    ("tag", "best model!", "letters, digits"), ("meta", "best model!", "letters, digits"),
    # (the refs' own names: the server refuses them at commit, after the upload)
    ("tag", "latest", "reserved"), ("meta", "rollback", "reserved"),
])
def test_a_malformed_tag_is_refused_before_the_upload(
    tmp_path: Path, shm: Path, how: str, name: str, said: str
) -> None:
    state = {"w": torch.arange(10.0)}
    bad: dict[str, Any] = {"tag": name} if how == "tag" else {"meta": {"tag": name}}
    with open_ckpt(tmp_path, shm) as ckpt:
        with pytest.raises(InvalidRequest, match=said):
            ckpt.save(3, state, **bad)
        assert ckpt.latest() is None  # nothing was uploaded, nothing failed behind
        # The loop fixes the tag and the same step commits, tagged.
        assert ckpt.save(3, state, tag="best-model").wait(30).state == "committed"
        assert ckpt.close().failed == 0
    tags = asyncio.run(read_tags(LocalStore(tmp_path / "store"), "j"))
    assert tags == {"best-model": 3}


MISTAKES: dict[str, tuple[dict[str, Any], str]] = {
    # save(...) keyword arguments -> what the message must say to do
    "shards value not a Shard": ({"shards": {"w": ([8], [0])}}, r"Shard\(global_shape"),
    "shards not a mapping": ({"shards": [("w", Shard([8], [0]))]}, "must map tensor names"),
    "local one string": ({"local": "m"}, r"local=\['m'\]"),
    "local not a list": ({"local": 5}, "list of tensor names"),
    "meta not a dict": ({"meta": 5}, "dict of JSON values"),
    "two tags": ({"tag": "a", "meta": {"tag": "b"}}, "pass the tag once"),
}


@pytest.mark.parametrize("kwargs,says", list(MISTAKES.values()), ids=list(MISTAKES))
def test_a_mistake_in_the_arguments_is_refused_typed_with_what_to_do(
    tmp_path: Path, shm: Path, kwargs: dict[str, Any], says: str
) -> None:
    state = {"w": torch.arange(8.0), "m": torch.ones(2, 2)}
    with open_ckpt(tmp_path, shm) as ckpt:
        with pytest.raises(InvalidRequest, match=says):
            ckpt.save(1, state, **kwargs)
        assert ckpt.latest() is None
        assert ckpt.save(1, state).wait(30).state == "committed"  # training goes on


@pytest.mark.parametrize(
    "shape,offsets", [(["a"], [0]), ([8], [None]), (8, [0]), ([8.5], [0])],
    ids=["str", "none", "not-a-list", "float"],
)
def test_a_shard_of_anything_but_ints_is_refused_typed(shape: Any, offsets: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"list of ints, e\.g\. Shard\("):
        Shard(shape, offsets)
    assert Shard(torch.Size([8, 2]), (0, 0)).global_shape == (8, 2)  # a Size is ints


def test_none_for_the_optional_arguments_means_none(tmp_path: Path, shm: Path) -> None:
    """(Found by a probe: ``local=None`` was refused as "not a list of tensor names",
    where ``shards=None`` and ``meta=None`` were taken.)"""
    with open_ckpt(tmp_path, shm) as ckpt:
        handle = ckpt.save(1, {"w": torch.ones(4)}, shards=None, local=None, meta=None)
        assert handle.wait(30).state == "committed"
