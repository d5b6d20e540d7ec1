"""DCP's ``StorageWriter`` on ckptd (``Writer``): each rank's write items become
one rank manifest, hashed and uploaded by the engine; the coordinator commits."""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptd import knobs
from ckptd.errors import (
    Conflict,
    InvalidRequest,
    NotCommitted,
    UnsupportedValue,
)
from ckptd.format import (
    EPOCH_META,
    INCARNATION_META,
    MAX_LOCAL_SHARDS,
    RankManifest,
    TensorEntry,
    canonical_json,
    check_step,
)
from ckptd.hashing import chunk_spans
from ckptd.knobs import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

from ..dtypes import byte_view, dtype_name
from ..launch import launch_incarnation
from ..loop import run_private
from ..restore.plan import DCP_ELSEWHERE
from ..save.chunks import hash_views, upload_missing
from ..save.flatten import not_storable, value_tree
from ..transport import Transport
from .target import (
    META_KEY,
    META_VERSION,
    _bare_step,
    _is_checkpoint_id,
    _require_where,
    _run,
    _where,
    checkpoint_id,
    parse_checkpoint_id,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _SavePlanData:
    """What the coordinator tells every rank in its plan (DCP's collectives carry it;
    the store never sees it): the checkpoint and the rank's place in it."""

    job: str
    step: int
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class WriteSummary:
    """What one rank's ``write_data`` did."""

    step: int
    rank: int
    world_size: int
    tensors: int
    values: int
    bytes_total: int
    bytes_sent: int
    chunks_total: int
    chunks_sent: int
    seconds: float


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that saves ``step`` of ``job`` to a ckptd server or
    store. Every rank uploads its own chunks and manifest; the coordinator commits.

    ``url``, ``job`` and ``step`` may instead come from ``dcp.save(checkpoint_id=...)``:
    ``ckptd+http://host:port/JOB/STEP``, ``ckptd+file:///dir/JOB/STEP`` (or without
    ``ckptd+``), or a bare step for the writer's own url and job; ``reset`` takes
    the next one, so one writer serves successive steps. ``url`` and ``token``
    default to ``CKPTD_URL`` and ``CKPTD_TOKEN``. ``timeout`` bounds each storage
    call (None: no bound)."""

    def __init__(
        self,
        url: str | None = None,
        job: str | None = None,
        step: int | None = None,
        token: str | None = None,
        *,
        chunk_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.url, self.job, self.token = _where(url, job, token)
        self.step = None if step is None else check_step(step)
        self.chunk_size = knobs.chunk_size() if chunk_size is None else int(chunk_size)
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidRequest(
                f"chunk_size {self.chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
            )
        self.timeout = timeout
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.last_write: WriteSummary | None = None
        # What this rank's local plan held, before DCP chose where each item several
        # ranks hold is saved (``prepare_local_plan``): those it saves elsewhere are
        # named in the manifest, for a restore of this rank (``DCP_ELSEWHERE``).
        self._planned: set[str] | None = None

    def __repr__(self) -> str:
        return f"Writer({self.url!r}, job={self.job!r}, step={self.step})"

    def _elsewhere(self, plan: SavePlan) -> dict[str, list[str]]:
        """The items this rank planned that DCP saves on another rank, as the
        manifest's ``meta["dcp"]`` names them (none known: nothing said)."""
        if self._planned is None:
            return {}
        written = {item.index.fqn for item in plan.items}
        return {DCP_ELSEWHERE: sorted(self._planned - written)}

    @property
    def checkpoint_id(self) -> str | None:
        if self.step is None or not self.url or not self.job:
            return None
        return checkpoint_id(self.url, self.job, self.step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.save_id = uuid.uuid4().hex
        self.last_write = None
        if checkpoint_id is None:
            return
        step = _bare_step(checkpoint_id)
        if step is None:
            url, job, parsed_step = parse_checkpoint_id(checkpoint_id)
            if parsed_step is None:
                raise InvalidRequest("a checkpoint is saved to a step, not to 'latest'")
            self.url, self.job, step = url, job, parsed_step
        self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_checkpoint_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # Without collectives no rank learns the world size, and a ckptd step
            # commits only when every rank of it is in.
            raise InvalidRequest("ckptd's DCP Writer needs use_collectives=True")
        self.is_coordinator = is_coordinator

    def _require_step(self) -> int:
        _require_where(self.url, self.job, "Writer")
        if self.step is None:
            raise InvalidRequest(
                "Writer has no step: pass step= or dcp.save(checkpoint_id=<step>)"
            )
        return self.step

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._require_step()
        # Refused early, on the rank that holds it, before any byte: what one rank
        # manifest cannot hold. Several shards of one tensor on one rank (a
        # ShardedTensor's local shards) are entries of one name (format 1.3).
        boxes: dict[str, list[WriteItem]] = {}
        for item in plan.items:
            boxes.setdefault(item.index.fqn, []).append(item)
            if item.tensor_data is not None:
                dtype_name(item.tensor_data.properties.dtype)
        for fqn, items in boxes.items():
            if len(items) > 1:
                _check_local_shards(fqn, items)
        self._planned = set(boxes)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        step = self._require_step()
        return [
            dataclasses.replace(
                plan,
                storage_data=_SavePlanData(self.job, step, rank=i, world_size=len(plans)),
            )
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        started = time.perf_counter()
        info = plan.storage_data
        if not isinstance(info, _SavePlanData):
            raise InvalidRequest("the save plan was not prepared by ckptd's Writer")
        if (info.job, info.step) != (self.job, self.step):
            raise Conflict(
                f"ranks disagree on the checkpoint: the coordinator saves {info.job} step "
                f"{info.step}, this rank {self.job} step {self.step}",
                step=info.step,
            )
        paths = plan.planner_data if isinstance(plan.planner_data, dict) else {}
        tree: list[list[Any]] = []
        tensors: list[tuple[WriteItem, torch.Tensor]] = []
        meta_paths: dict[str, list[str | int]] = {}
        results: list[WriteResult] = []
        blobs: list[tuple[str, torch.Tensor]] = []
        values = 0
        for item in plan.items:
            fqn = item.index.fqn
            if fqn in meta_paths and item.type != WriteItemType.BYTE_IO:
                if _repeats_empty_box(item, tensors):
                    # An empty shard at a box another one of this rank holds: nothing
                    # to store (a manifest holds each box once), as FileSystemWriter.
                    results.append(WriteResult(item.index, 0, None))
                    continue
                # Another local shard of a tensor already in the tree: one more entry
                # of its name, the tree names it once.
                tensors.append((item, _write_tensor(item, planner.resolve_data(item))))
                continue
            meta_paths[fqn] = _json_path(paths.get(fqn), fqn)
            if item.type == WriteItemType.BYTE_IO:
                resolved = planner.resolve_data(item)
                node = _decode_value(resolved, fqn,
                                     refused=functools.partial(_refusal, fqn, planner, item))
                if node is None:  # not a plain value: an opaque, verified blob
                    blob = _blob(resolved, fqn)
                    blobs.append((fqn, blob))
                    tree.append([fqn, {"bytes": fqn}])
                    results.append(WriteResult(item.index, blob.numel(), None))
                else:
                    tree.append([fqn, node])
                    results.append(WriteResult(item.index, len(canonical_json(node)), None))
                values += 1
            else:
                tensor = _write_tensor(item, planner.resolve_data(item))
                tensors.append((item, tensor))
                tree.append([fqn, {"tensor": fqn}])
        entries, data = _entries(tensors, blobs, self.chunk_size, self.timeout)
        launch = launch_incarnation()
        for (item, _), entry in zip(tensors, entries, strict=False):
            results.append(WriteResult(item.index, entry.nbytes, None))
        manifest = RankManifest(
            job=self.job,
            step=info.step,
            rank=info.rank,
            world_size=info.world_size,
            chunk_size=self.chunk_size,
            entries=entries,
            tree={"dict": tree},
            meta={META_KEY: {"version": META_VERSION, "paths": meta_paths,
                             **self._elsewhere(plan)},
                  # (docs/FORMAT.md "Launches": no step pairs two launches' manifests)
                  **({} if launch is None else {INCARNATION_META: launch})},
        )
        manifest.check()  # a bad manifest fails here, before any byte is sent
        claimer = f"{self.job}/{info.rank}"

        async def work(transport: Transport) -> tuple[int, int]:
            # DCP saves keep no state between calls: each joins the job's timeline
            # as it is when it writes (see Checkpointer for fenced saves).
            epoch = await transport.epoch(self.job)
            stamped = (manifest if not epoch else
                       manifest.model_copy(update={"meta": {**manifest.meta, EPOCH_META: epoch}}))
            sent = await upload_missing(transport, data, claimer, what=f"step {info.step}")
            await transport.put_manifest(stamped)
            return sent

        chunks_sent, bytes_sent = _run(self.url, self.token, work, self.timeout, self.job)
        self.last_write = WriteSummary(
            step=info.step,
            rank=info.rank,
            world_size=info.world_size,
            tensors=len(entries),
            values=values,
            bytes_total=manifest.nbytes,
            bytes_sent=bytes_sent,
            chunks_total=len(data),
            chunks_sent=chunks_sent,
            seconds=time.perf_counter() - started,
        )
        log.info("%s step %d rank %d/%d: %d tensors, %d values, %d of %d bytes sent",
                 self.job, info.step, info.rank, info.world_size, len(entries), values,
                 bytes_sent, manifest.nbytes)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commits the step (the coordinator, once every rank's manifest is in).

        DCP's ``metadata`` is not stored: ``Reader.read_metadata`` rebuilds it from
        the committed manifests."""
        step = self._require_step()
        # The launch, as the manifests name it: a relaunch with fewer ranks then
        # commits without the dead launch's ranks past its world size.
        launch = launch_incarnation()
        meta = {"producer": "ckptd.client.dcp",
                **({} if launch is None else {INCARNATION_META: launch})}
        status = _run(self.url, self.token, lambda t: t.commit(self.job, step, meta),
                      self.timeout)
        if status.state != "committed":
            raise NotCommitted(
                f"{self.job} step {step} did not commit: ranks {status.missing_ranks[:20]} "
                "have no manifest",
                step=step,
                missing_ranks=status.missing_ranks[:50],
            )
        log.info("%s step %d committed (%d ranks)", self.job, step, status.world_size or 0)


def _repeats_empty_box(item: WriteItem, taken: list[tuple[WriteItem, torch.Tensor]]) -> bool:
    """Whether ``item`` is an empty shard whose box an item of ``taken`` has already."""
    data = item.tensor_data
    if data is None or math.prod(data.chunk.sizes) != 0:
        return False
    box = (list(data.chunk.offsets), list(data.chunk.sizes))
    return any(t.index.fqn == item.index.fqn and t.tensor_data is not None
               and (list(t.tensor_data.chunk.offsets), list(t.tensor_data.chunk.sizes)) == box
               for t, _ in taken)


def _check_local_shards(fqn: str, items: list[WriteItem]) -> None:
    """Several items of one fqn on one rank: shards of one tensor, each its own box,
    none overlapping another; anything else cannot be one tensor's entries."""
    if any(i.tensor_data is None for i in items):
        raise UnsupportedValue(f"{fqn!r} is both a value and a tensor on one rank", name=fqn)
    if len(items) > MAX_LOCAL_SHARDS:
        raise UnsupportedValue(
            f"{fqn!r} has {len(items)} shards on this rank; ckptd stores at most "
            f"{MAX_LOCAL_SHARDS} shards of one tensor per rank", name=fqn)
    seen: list[tuple[list[int], list[int]]] = []
    for item in items:
        assert item.tensor_data is not None
        offsets = [int(d) for d in item.tensor_data.chunk.offsets]
        sizes = [int(d) for d in item.tensor_data.chunk.sizes]
        for o, s in seen:
            if math.prod(s) and math.prod(sizes) and all(
                a < b + m and b < a + n for a, n, b, m in zip(o, s, offsets, sizes, strict=True)
            ):
                raise UnsupportedValue(
                    f"{fqn!r}: two shards on this rank overlap ({o}+{s} and {offsets}+{sizes}); "
                    "each element of a tensor is saved once", name=fqn)
        seen.append((offsets, sizes))


def _json_path(path: Any, fqn: str) -> list[str | int]:
    """DCP's object path of ``fqn`` as JSON (strings and integers only)."""
    if path is None:
        return [fqn]
    out: list[str | int] = []
    for p in path:
        if isinstance(p, bool) or not isinstance(p, str | int):
            raise UnsupportedValue(f"{fqn!r}: DCP path element {p!r} is not a str or int")
        out.append(p)
    return out


def _decode_value(data: Any, fqn: str,
                  refused: Callable[[], UnsupportedValue] | None = None) -> dict[str, Any] | None:
    """The tree node of a non-tensor item, which DCP hands over ``torch.save``-d,
    or None when it is not a plain value (then it is stored as an opaque blob).

    Loaded with ``weights_only=True`` (no code runs) and stored as JSON, never as
    the pickle. One that loading refuses (an arbitrary object) is refused here, at
    save, with ``refused()``'s error: a load would have to unpickle it from the store."""
    if isinstance(data, io.BytesIO):
        data.seek(0)
        try:
            value = load_value(data)
        except Exception:
            raise (_refusal(fqn) if refused is None else refused()) from None
    elif isinstance(data, bytes | bytearray | memoryview):
        return None
    else:  # a custom planner may resolve to the object itself
        value = data
    try:
        return value_tree(value, fqn)
    except UnsupportedValue:
        if isinstance(data, io.BytesIO):
            return None
        raise


def _refusal(fqn: str, planner: SavePlanner | None = None,
             item: WriteItem | None = None) -> UnsupportedValue:
    """Why a value that weights_only loading refuses is not saved, as a Checkpointer
    says it (naming its type), from the object itself where the planner can look it
    up (``DefaultSavePlanner.lookup_object``). Not torch's load-time message: that
    one speaks of a file, and of loading it anyway."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup) and item is not None:
        try:
            value_tree(lookup(item.index), fqn)
        except UnsupportedValue as exc:
            return exc
        except Exception as exc:  # (a custom planner's lookup): said without the type
            log.debug("looking up %r in the save planner: %s", fqn, exc)
    return UnsupportedValue(
        f"{fqn!r} is an object which ckptd cannot store without pickling (weights_only "
        "loading refuses it, and nothing in a store is ever unpickled): save plain "
        "values, tensors or bytes", name=fqn)


def load_value(data: io.BytesIO) -> Any:
    """A ``torch.save``-d non-tensor value, loaded with ``weights_only=True``: plain
    types, tensors and ``io.BytesIO`` (which DCP's planner pickles for a BytesIO
    item of a state dict) are built, any other object refused, no code run."""
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(data, weights_only=True)


def _blob(data: Any, fqn: str) -> torch.Tensor:
    """The bytes DCP handed over for an item, as a 1-D uint8 tensor (a copy)."""
    if isinstance(data, io.BytesIO):
        raw = data.getvalue()
    elif isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
    else:
        raise UnsupportedValue(
            f"{fqn!r}: the planner resolved a bytes item to a {type(data).__name__}, "
            "not bytes", name=fqn)
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _write_tensor(item: WriteItem, resolved: Any) -> torch.Tensor:
    """The item's tensor as a contiguous CPU tensor of the item's box shape."""
    fqn = item.index.fqn
    if not isinstance(resolved, torch.Tensor) or item.tensor_data is None:
        raise InvalidRequest(f"{fqn!r}: the planner resolved a tensor item to {type(resolved)}")
    tensor = resolved.detach()
    refusal = not_storable(tensor)  # (as a Checkpointer says it; before any upload)
    if refusal is not None:
        raise UnsupportedValue(f"{fqn!r} {refusal}", name=fqn)
    tensor = tensor.to("cpu").contiguous()
    sizes = [int(d) for d in item.tensor_data.chunk.sizes]
    if list(tensor.shape) != sizes:
        raise InvalidRequest(f"{fqn!r}: resolved shape {list(tensor.shape)}, plan says {sizes}")
    dtype_name(tensor.dtype)
    return tensor


def _entries(
    tensors: list[tuple[WriteItem, torch.Tensor]], blobs: list[tuple[str, torch.Tensor]],
    chunk_size: int, timeout: float | None,
) -> tuple[list[TensorEntry], dict[str, memoryview]]:
    """Entries of the items' tensors (``sharded``: the item's box of its global
    tensor) and of opaque blobs (1-D uint8, ``replicated``: DCP writes each item on
    one rank), and the unique chunks' bytes, hashed by the engine without a copy."""
    views = [byte_view(t) for _, t in tensors] + [byte_view(b) for _, b in blobs]
    ids = run_private(hash_views(views, chunk_size), timeout, what="hashing a DCP save")
    data: dict[str, memoryview] = {}
    for view, chunk_ids in zip(views, ids, strict=True):
        for cid, (a, b) in zip(chunk_ids, chunk_spans(len(view), chunk_size), strict=True):
            data.setdefault(cid, view[a:b])
    entries: list[TensorEntry] = []
    for (item, tensor), view, chunk_ids in zip(tensors, views, ids, strict=False):
        if item.tensor_data is None:  # _write_tensor refused it already
            raise InvalidRequest(f"{item.index.fqn!r}: a tensor item without tensor data")
        entries.append(TensorEntry(
            name=item.index.fqn,
            dtype=dtype_name(tensor.dtype),
            placement="sharded",
            global_shape=[int(d) for d in item.tensor_data.size],
            offsets=[int(d) for d in item.tensor_data.chunk.offsets],
            shape=[int(d) for d in tensor.shape],
            nbytes=len(view),
            chunks=chunk_ids,
        ))
    for (fqn, blob), chunk_ids in zip(blobs, ids[len(tensors):], strict=True):
        n = int(blob.numel())
        entries.append(TensorEntry(name=fqn, dtype="uint8", placement="replicated",
                                   global_shape=[n], offsets=[0], shape=[n], nbytes=n,
                                   chunks=chunk_ids))
    return entries, data
