"""torch.distributed.checkpoint on ckptd: dcp.save and dcp.async_save by 4 gloo
ranks through ``Writer``, dcp.load by 2 ranks through ``Reader``; values equal,
DCP's metadata and non-tensor values kept as JSON, never pickled. The single
process tests use DCP's ``no_dist`` mode."""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItem

from ckptd.client import Checkpointer
from ckptd.client.dcp import Reader, Writer, checkpoint_id, parse_checkpoint_id
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    InvalidRequest,
    Unavailable,
    UnsupportedValue,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def manifests(store: Path, job: str, step: int) -> list[dict[str, Any]]:
    ranks = sorted((store / f"jobs/{job}/steps/{step}/ranks").glob("*.json"))
    return [json.loads(p.read_text()) for p in ranks]


def assert_no_pickle(store: Path, job: str, step: int) -> None:
    """Values sit in the manifests' trees as JSON; chunks hold tensor bytes only."""
    docs = manifests(store, job, step)
    referenced: set[str] = set()
    for doc in docs:
        assert doc["meta"]["dcp"]["version"] == 1
        names = {e["name"] for e in doc["entries"]}
        for fqn, node in doc["tree"]["dict"]:
            kind = next(iter(node))
            assert kind in ("tensor", "value", "float", "list", "tuple", "dict", "bytes"), fqn
            assert (kind in ("tensor", "bytes")) == (fqn in names), fqn
        referenced |= {cid for e in doc["entries"] for cid in e["chunks"]}
    stored = {p.name for p in (store / "chunks").glob("*/*")}
    assert referenced <= stored
    for path in (store / f"jobs/{job}").rglob("*"):
        if path.is_file():
            assert not path.read_bytes().startswith(b"\x80"), path  # no pickle anywhere


@pytest.mark.slow
def test_dcp_save_on_4_ranks_async_save_and_load_on_2_ranks(
    server: Any, torchrun: Any, tmp_path: Path
) -> None:
    saved = torchrun("dcp_save.py", 4, server.url, "dcp", out=tmp_path / "save")
    assert [r["rank_in_manifest"] for r in saved] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 for r in saved)
    # DCP writes each replicated item (a plain tensor, a Replicate DTensor, a value)
    # on one rank only: the manifests together hold every item once.
    docs = manifests(server.store, "dcp", 1)
    fqns = [fqn for d in docs for fqn, _ in d["tree"]["dict"]]
    for fqn in set(fqns):
        sharded = fqn in ("model.w", "model.big", "model.w2", "model.emb",
                          "optim.state.model.w.exp_avg")
        assert fqns.count(fqn) == (4 if sharded else 1), fqn
    by_fqn = {fqn: node for d in docs for fqn, node in d["tree"]["dict"]}
    assert by_fqn["epoch"] == {"value": 1}
    assert by_fqn["note"] == {"value": "héllo 1"}
    assert by_fqn["best"] == {"float": "inf"}
    assert by_fqn["optim.param_groups.0.betas"] == {"tuple": [{"value": 0.9}, {"value": 0.99}]}
    boxes = sorted((e["offsets"], e["shape"]) for d in docs for e in d["entries"]
                   if e["name"] == "model.w")
    assert boxes == [([0, 0], [3, 6]), ([3, 0], [3, 6]), ([6, 0], [3, 6]), ([9, 0], [1, 6])]
    for step in (1, 2):
        commit = json.loads((server.store / f"jobs/dcp/steps/{step}/commit.json").read_text())
        # The launch, as the ranks' manifests name it (torchrun's run id, restart
        # count and its agent's own id, one node here): a smaller relaunch then
        # commits without this one.
        launch = docs[0]["meta"]["incarnation"]
        assert re.fullmatch(r"torchelastic:[^:]+:0:[0-9a-f]{32}", launch), launch
        assert commit["world_size"] == 4 and commit["meta"] == {
            "producer": "ckptd.client.dcp", "incarnation": launch}
        assert_no_pickle(server.store, "dcp", step)

    loaded = torchrun("dcp_load.py", 2, server.url, "dcp", out=tmp_path / "load")
    total = sum(r["bytes_total"][0] for r in saved)
    for rank, r in enumerate(loaded):
        for step in ("1", "2"):
            got = r[step]
            assert got["loaded_step"] == int(step)
            assert all(got["tensors"].values()), (rank, step, got["tensors"])
            assert {k: v for k, v in got.items() if k not in ("tensors", "loaded_step",
                                                             "bytes_read")} == {
                "dtensors_kept": True, "optim_step": True, "epoch": True, "note": True,
                "best": True, "param_groups": True, "betas_tuple": True}, (rank, step)
            # A rank reads the chunks that cover its shards, not the whole checkpoint.
            assert 0 < got["bytes_read"] < total, (rank, step)


# -- one process (no_dist) ---------------------------------------------------------------


def small_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": seed,
            "big": torch.randn(64, 64)}


def assert_state_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_state_equal(x, y)
    else:
        assert a == b


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*single process.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent.*")
        yield


def test_single_process_round_trip_and_latest(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    for step in (1, 2):
        dcp.save(small_state(step), storage_writer=Writer(url, "j", step, chunk_size=4096),
                 no_dist=True)
    target = small_state(99)
    reader = Reader(url, "j")
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.loaded_step == 2
    assert_state_equal(small_state(2), target)
    earlier = small_state(98)
    dcp.load(earlier, storage_reader=Reader(url, "j"), checkpoint_id=1, no_dist=True)
    assert_state_equal(small_state(1), earlier)
    assert_no_pickle(tmp_path / "store", "j", 2)


def test_checkpoint_ids() -> None:
    assert checkpoint_id("http://h:7070/", "llm", 5) == "http://h:7070/llm/5"
    assert parse_checkpoint_id("http://h:7070/llm/5") == ("http://h:7070", "llm", 5)
    assert parse_checkpoint_id("https://h/p/x/llm/latest") == ("https://h/p/x", "llm", None)
    assert parse_checkpoint_id("file:///tmp/st/llm/0") == ("file:///tmp/st", "llm", 0)
    for bad in ("/tmp/x/llm/5", "http://h/llm/five", "http://h/5", "s3://b/llm/5",
                "http://h/../5"):
        assert not Writer.validate_checkpoint_id(bad), bad
        with pytest.raises(InvalidRequest):
            parse_checkpoint_id(bad)
    assert Reader.validate_checkpoint_id("http://h:1/llm/latest")
    w = Writer("http://a:1", "one")
    w.reset("http://b:2/two/7")
    assert (w.url, w.job, w.step, w.checkpoint_id) == ("http://b:2", "two", 7, "http://b:2/two/7")
    w.reset(8)
    assert w.checkpoint_id == "http://b:2/two/8"
    with pytest.raises(InvalidRequest):
        w.reset("http://b:2/two/latest")


def failure(info: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    ((exc, _tb),) = info.value.failures.values()
    return exc


def test_values_that_are_not_plain_json_are_opaque_blobs(tmp_path: Path) -> None:
    # What DCP torch.save-s and torch.load(weights_only=True) cannot read back as a
    # plain value is stored as DCP handed it over: an opaque, verified blob, read
    # back with weights_only=True (the planner gets bytes ckptd saved itself).
    store = tmp_path / "store"
    url = f"file://{store}"
    dcp.save({"w": torch.ones(2), "x": {1, 2}, "raw": b"raw"},
             storage_writer=Writer(url, "j", 1), no_dist=True)
    (doc,) = manifests(store, "j", 1)
    tree = dict(doc["tree"]["dict"])
    assert tree["x"] == {"bytes": "x"} and tree["raw"] == {"bytes": "raw"}
    target: dict[str, Any] = {"w": torch.zeros(2), "x": None, "raw": None}
    dcp.load(target, storage_reader=Reader(url, "j"), no_dist=True)
    assert target["x"] == {1, 2} and target["raw"] == b"raw"
    assert torch.equal(target["w"], torch.ones(2))


def test_a_writer_needs_a_step(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2)}, storage_writer=Writer(f"file://{tmp_path}", "j"),
                 no_dist=True)
    assert isinstance(failure(info), InvalidRequest)


def test_reading_a_job_without_checkpoints_is_a_typed_error(tmp_path: Path) -> None:
    # A first run's resume: `except CheckpointNotFound: start fresh`, before any save
    # made the store (found by review: the missing store was NotFound, its parent).
    where = tmp_path / "store"
    with pytest.raises(CheckpointNotFound, match=str(where)):
        Reader(f"file://{where}", "none", step=3)
    with pytest.raises(CheckpointNotFound, match=str(where)):
        Reader(f"file://{where}", "none").read_metadata()
    assert not where.exists()
    where.mkdir()  # an empty store: no checkpoint of the job either
    with pytest.raises(CheckpointNotFound):
        Reader(f"file://{where}", "none").read_metadata()


def test_a_server_not_answering_is_said_by_the_load_not_by_the_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(found by review) ``reset`` runs on each rank before DCP's first collective:
    only a step known missing is raised there; one rank's unanswered call raised
    there would leave the other ranks waiting in the collective."""
    from tests.conftest import free_port

    monkeypatch.setenv("CKPTD_RETRIES", "0")
    reader = Reader(f"http://127.0.0.1:{free_port()}", "j", step=3)  # (not raised here)
    with pytest.raises(Unavailable):
        reader.read_metadata()


def test_a_corrupt_chunk_is_detected_on_load(tmp_path: Path) -> None:
    store = tmp_path / "store"
    url = f"file://{store}"
    state = {"big": torch.arange(4096, dtype=torch.float32)}
    dcp.save(state, storage_writer=Writer(url, "j", 1, chunk_size=4096), no_dist=True)
    (entry,) = manifests(store, "j", 1)[0]["entries"]
    victim = store / "chunks" / entry["chunks"][2][:2] / entry["chunks"][2]
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    target = {"big": torch.zeros(4096)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=Reader(url, "j"), no_dist=True)
    assert isinstance(failure(info), ChunkHashMismatch)


def test_a_checkpointer_save_loads_through_dcp(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    state = small_state(3)
    state["sched"] = {"last_epoch": 4, "_last_lr": [0.5], "best": float("nan")}
    with Checkpointer(url, "ck", chunk_size=4096) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
    target = small_state(50)
    target["sched"] = {"last_epoch": 0, "_last_lr": [0.0], "best": 0.0}
    dcp.load(target, storage_reader=Reader(url, "ck"), no_dist=True)
    nan = target["sched"].pop("best")
    assert nan != nan
    state["sched"].pop("best")
    assert_state_equal(state, target)



def test_dcp_load_reads_this_ranks_staging_pool_before_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The restore engine's tiers under dcp.load: a step a Checkpointer saved is
    # still in this rank's pool, so its chunks come from there (verified), and
    # from the store once the pool is gone.
    monkeypatch.setenv("CKPTD_SHM_DIR", str(tmp_path / "shm"))
    url = f"file://{tmp_path / 'store'}"
    state = {"w": torch.randn(256, 64), "b": torch.arange(1000), "n": 7}

    def empty() -> dict[str, Any]:
        return {"w": torch.zeros(256, 64), "b": torch.zeros(1000, dtype=torch.int64), "n": 0}

    with Checkpointer(url, "pooled", chunk_size=4096) as ckpt:
        assert ckpt.save(1, state).wait(timeout=30).state == "committed"
        target = empty()
        reader = Reader(url, "pooled")
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_state_equal(state, target)
        assert reader.bytes_from.get("local", 0) == reader.bytes_read > 0
    after = empty()
    reader = Reader(url, "pooled")
    dcp.load(after, storage_reader=reader, no_dist=True)
    assert_state_equal(state, after)
    assert reader.bytes_from.get("local", 0) == 0 and reader.bytes_from["store"] > 0


class _Planted:
    """An object whose unpickling runs code (it would create ``marker``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.marker),))


def test_an_object_that_weights_only_loading_refuses_is_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2), "obj": _Planted(str(tmp_path / "ran"))},
                 storage_writer=Writer(f"file://{tmp_path / 'store'}", "j", 1), no_dist=True)
    assert isinstance(failure(info), UnsupportedValue) and "'obj'" in str(failure(info))
    assert not (tmp_path / "ran").exists()


def test_a_meta_tensor_is_refused_before_any_upload_saying_what_to_do(tmp_path: Path) -> None:
    """(Found by a probe: torch's NotImplementedError "Cannot copy out of meta
    tensor", which ckptd_error did not find; a Checkpointer refuses it typed.)"""
    from ckptd.client.dcp import ckptd_error

    store = tmp_path / "store"
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2), "m": torch.empty(2, device="meta")},
                 storage_writer=Writer(f"file://{store}", "j", 1), no_dist=True)
    err = ckptd_error(info.value)
    assert isinstance(err, UnsupportedValue) and "'m'" in str(err), info.value
    assert "meta device" in str(err) and "to_empty(" in str(err)
    assert not list(store.glob("chunks/*/*")) and not list(store.glob("jobs/*/steps/*/ranks/*"))


class _RawBytesPlanner(DefaultSavePlanner):
    """A user's planner that hands the writer DCP's pickled items as raw bytes: the
    writer stores bytes as they are, so an object's pickle lands in the store (as
    from a writer older than the save-time refusal)."""

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        return data.getvalue() if isinstance(data, io.BytesIO) else data


def test_a_planted_pickle_in_the_store_is_never_unpickled_on_load(tmp_path: Path) -> None:
    """A stored object's pickle: the Reader reads it with weights_only=True and
    refuses it; DCP's planner, which would unpickle it with weights_only=False,
    never sees the store's bytes. (Found by a probe: the refusal quoted torch's
    load-time message, about a "file", with terminal escape codes in it.)"""
    url = f"file://{tmp_path / 'store'}"
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "obj": _Planted(str(marker))},
             storage_writer=Writer(url, "j", 1), planner=_RawBytesPlanner(), no_dist=True)
    assert not marker.exists()
    target: dict[str, Any] = {"w": torch.zeros(2), "obj": None}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=Reader(url, "j"), no_dist=True)
    err = failure(info)
    message = str(err)
    assert "\n" not in message and "\x1b" not in message and "file" not in message, message
    assert message.startswith("'obj' of step 1 is stored as a pickle"), message
    assert isinstance(err, UnsupportedValue) and err.detail == {"name": "obj", "step": 1}
    assert "as a tensor or a plain value" in message and "Checkpointer.restore" in message
    # What weights_only refused, and the way to load a trusted type that stays weights-only.
    assert "refuses (the object " in message and "add_safe_globals" in message, message
    assert "weights_only=False" not in message, message
    assert not marker.exists()
    # What the message offers: the stored bytes, never loaded by ckptd.
    restored: dict[str, Any] = {}
    with Checkpointer(url, "j") as ckpt:
        ckpt.restore(restored, 1)
    assert isinstance(restored["obj"], bytes) and restored["obj"].startswith(b"PK")
    assert not marker.exists()
