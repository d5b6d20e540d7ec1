"""DCP as its users write it, in one process (``no_dist``): bytes items stored as
opaque verified blobs, checkpoint ids of the ``ckptd+`` forms and ``reset`` for
successive steps, and ckptd's typed errors inside DCP's ``CheckpointException``."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptd.client import Checkpointer
from ckptd.client.dcp import Reader, Writer, ckptd_error, parse_checkpoint_id
from ckptd.errors import ChunkHashMismatch, InvalidDocument, InvalidRequest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*single process.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent.*")
        yield


def _rank0(store: Path, job: str, step: int) -> dict[str, Any]:
    return json.loads((store / f"jobs/{job}/steps/{step}/ranks/0.json").read_text())


@pytest.mark.parametrize("where", ["file", "http"])
def test_bytes_and_bytesio_items_round_trip_as_written(
    where: str, tmp_path: Path, server: Any
) -> None:
    store = tmp_path / "store" if where == "http" else tmp_path / "fstore"
    url = server.url if where == "http" else f"file://{store}"
    losses = io.BytesIO()
    torch.save([1.5, 2.5], losses)  # what DDP's train_state.losses looks like
    blob = bytes(range(256)) * 40  # several chunks
    state = {"w": torch.arange(6.0), "blob": blob, "train_state": {"losses": losses}}
    dcp.save(state, storage_writer=Writer(url, "b", 1, chunk_size=4096), no_dist=True)
    tree = dict(_rank0(store, "b", 1)["tree"]["dict"])
    assert tree["blob"] == {"bytes": "blob"}
    target: dict[str, Any] = {"w": torch.zeros(6), "blob": b"", "train_state": {"losses": None}}
    dcp.load(target, storage_reader=Reader(url, "b"), no_dist=True)
    assert target["blob"] == blob
    assert isinstance(target["train_state"]["losses"], io.BytesIO)
    assert target["train_state"]["losses"].getvalue() == losses.getvalue()
    assert torch.equal(target["w"], torch.arange(6.0))


def test_a_bytes_leaf_round_trips_through_the_checkpointer(tmp_path: Path, shm: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    with Checkpointer(url, "ck", shm_dir=shm, chunk_size=4096) as ckpt:
        ckpt.save(1, {"raw": b"\x80\x04opaque" * 1000, "e": b"", "n": 3}).wait(60)
        target: dict[str, Any] = {"raw": None, "e": None, "n": 0}
        assert ckpt.restore(target).step == 1
    assert target == {"raw": b"\x80\x04opaque" * 1000, "e": b"", "n": 3}


def test_checkpoint_id_forms_and_reset_for_successive_steps(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert parse_checkpoint_id("ckptd+http://h:7070/llm/5") == ("http://h:7070", "llm", 5)
    assert parse_checkpoint_id(f"ckptd+file://{store}/llm/0") == (f"file://{store}", "llm", 0)
    for good in ("ckptd+http://h:1/j/3", f"ckptd+file://{store}/j/3", "http://h:1/j/3"):
        assert Writer.validate_checkpoint_id(good) and Reader.validate_checkpoint_id(good)
    for bad in ("ckptd+s3://b/j/3", "ckptd+http://h/j/x", "/plain/dir", "ckptd+http://h/3"):
        assert not Writer.validate_checkpoint_id(bad), bad
    writer = Writer()  # url, job and step all from the checkpoint ids
    for step in (1, 2, 3):
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=writer,
                 checkpoint_id=f"ckptd+file://{store}/j/{step}", no_dist=True)
    assert writer.checkpoint_id == f"file://{store}/j/3"
    target = {"w": torch.zeros(3)}
    dcp.load(target, storage_reader=Reader(), checkpoint_id=f"ckptd+file://{store}/j/2",
             no_dist=True)
    assert torch.equal(target["w"], torch.full((3,), 2.0))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(1)}, storage_writer=Writer(), no_dist=True)
    err = ckptd_error(info.value)
    assert isinstance(err, InvalidRequest) and "checkpoint_id" in str(err)


def test_a_writer_and_reader_read_ckptd_url_from_the_environment(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_URL", server.url)
    dcp.save({"w": torch.ones(2)}, storage_writer=Writer(job="env", step=4), no_dist=True)
    target = {"w": torch.zeros(2)}
    dcp.load(target, storage_reader=Reader(job="env"), no_dist=True)
    assert torch.equal(target["w"], torch.ones(2))


def test_errors_keep_their_type_and_a_corrupt_chunk_names_its_tensor_over_http(
    tmp_path: Path, server: Any
) -> None:
    store = tmp_path / "store"
    dcp.save({"big": torch.arange(4096, dtype=torch.float32)},
             storage_writer=Writer(server.url, "c", 1, chunk_size=4096), no_dist=True)
    (entry,) = _rank0(store, "c", 1)["entries"]
    victim = store / "chunks" / entry["chunks"][1][:2] / entry["chunks"][1]
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"big": torch.zeros(4096)}, storage_reader=Reader(server.url, "c"),
                 no_dist=True)
    err = ckptd_error(info.value)
    assert isinstance(err, ChunkHashMismatch) and "'big'" in str(err)
    assert "\x1b[" not in str(err)


def test_a_fqn_that_is_a_tensor_on_one_rank_and_a_value_on_another_is_typed(
    tmp_path: Path,
) -> None:
    from ckptd.format import RankManifest

    store = tmp_path / "store"
    url = f"file://{store}"
    dcp.save({"x": torch.ones(2)}, storage_writer=Writer(url, "m", 1), no_dist=True)
    doc = _rank0(store, "m", 1)
    reader = Reader(url, "m")
    index_fn = reader._read_index

    async def mixed(transport: Any) -> Any:
        index = await index_fn(transport)
        index.values["x"] = {"value": 1}  # another rank's manifest says it is a value
        return index

    reader._read_index = mixed  # type: ignore[method-assign]
    with pytest.raises(InvalidDocument):
        reader.read_metadata()
    assert RankManifest.model_validate(doc)


class BlobState:
    """A Stateful whose state is raw bytes (after PyTorch's file-system DCP test)."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def test_a_stateful_holding_bytes_round_trips(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    torch.manual_seed(0)
    saved: dict[str, Any] = dict(torch.nn.Linear(5, 5).state_dict())
    saved["test_blob"] = BlobState(b"SomeBlobForTesting")
    dcp.save(saved, storage_writer=Writer(url, "blob", 1), no_dist=True)
    torch.manual_seed(1)
    target: dict[str, Any] = dict(torch.nn.Linear(5, 5).state_dict())
    target["test_blob"] = BlobState(b"")
    dcp.load(target, storage_reader=Reader(url, "blob", 1), no_dist=True)
    assert target["test_blob"].state == {"blob": b"SomeBlobForTesting"}
    assert all(torch.equal(saved[k], target[k]) for k in ("weight", "bias"))


def test_dtype_casting_on_load_follows_dcps_planner(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    w = torch.rand(4, 3)
    dcp.save({"w": w}, storage_writer=Writer(url, "cast", 1), no_dist=True)
    narrow = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(narrow, storage_reader=Reader(url, "cast", 1), no_dist=True)
    assert torch.equal(narrow["w"], w.to(torch.bfloat16))
    wide = {"w": torch.zeros(4, 3, dtype=torch.float64)}
    dcp.load(wide, storage_reader=Reader(url, "cast", 1), no_dist=True)
    assert torch.equal(wide["w"], w.double())
