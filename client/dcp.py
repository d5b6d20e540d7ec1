"""torch.distributed.checkpoint (DCP) on ckptd: ``Writer`` and ``Reader`` are a
``StorageWriter`` and a ``StorageReader`` over the same chunk store as
``Checkpointer``, so ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` work with a
ckptd server (``http://host:port``) or a local store (``file:///path``)::

    import torch.distributed.checkpoint as dcp
    from ckptd.client.dcp import Reader, Writer

    dcp.save(state, storage_writer=Writer("http://ckptd:7070", job="llm", step=step))
    dcp.load(state, storage_reader=Reader("http://ckptd:7070", job="llm"))  # latest

A DCP save of one step is one ckptd checkpoint: every rank hashes and uploads the
tensors of its write items as ``sharded`` entries (the fully qualified name, the
global size and the item's box), turns the non-tensor items (which DCP hands over
``torch.save``-d) back into plain values stored as JSON in its manifest's tree,
and puts its manifest; the coordinator's ``finish`` commits, which validates that
the boxes tile every tensor. Nothing is pickled into the store: ``read_metadata``
rebuilds DCP's ``Metadata`` from the committed manifests, and ``read_data`` reads
any sub-box of a stored shard from the chunks that cover it (verifying each), so a
checkpoint saved by N ranks loads into M ranks.

Checkpoint ids (for ``dcp.save(checkpoint_id=...)``) are ``<url>/<job>/<step>``, or
a bare step for the writer's or reader's own url and job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlparse, urlunparse

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptd import knobs
from ckptd.dtypes import itemsize
from ckptd.errors import (
    CheckpointNotFound,
    CkptdError,
    Conflict,
    InvalidDocument,
    InvalidRequest,
    NotCommitted,
    RestoreError,
    UnsupportedValue,
)
from ckptd.format import (
    EPOCH_META,
    RankManifest,
    TensorEntry,
    canonical_json,
    check_job,
    check_step,
)
from ckptd.geometry import covering_chunks
from ckptd.hashing import chunk_spans
from ckptd.knobs import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, MiB

from .dtypes import byte_view, dtype_name, torch_dtype
from .loop import run_private
from .restore.fetch import ChunkFetcher, WantedChunks, deliver, failure
from .restore.fill import unflatten
from .restore.sources import DirectoryCacheSource, LocalStoreSource, Source, StoreSource
from .save.chunks import hash_views, upload_missing
from .save.flatten import value_tree
from .transport import Transport, open_transport

log = logging.getLogger(__name__)

T = TypeVar("T")

# The manifest ``meta`` key that marks a DCP-written manifest: its tree is flat,
# ``{fqn: node}``, and ``meta["dcp"]["paths"]`` maps each fqn to DCP's object path
# (``Metadata.planner_data``: how the flat key nests in the user's state dict).
META_KEY = "dcp"
META_VERSION = 1

# Shard buffers one ``read_data`` batch may hold at once (bytes).
DEFAULT_READ_BUDGET = 256 * MiB

_SCHEMES = ("http", "https", "file")
_PREFIX = "ckptd+"  # ckptd+http://host:port/JOB/STEP, ckptd+file:///dir/JOB/STEP


# -- checkpoint ids ---------------------------------------------------------------------


def checkpoint_id(url: str, job: str, step: int) -> str:
    """The DCP checkpoint id of ``step`` of ``job`` at ``url``: ``<url>/<job>/<step>``."""
    return f"{url.rstrip('/')}/{check_job(job)}/{check_step(step)}"


def parse_checkpoint_id(value: str | os.PathLike[str]) -> tuple[str, str, int | None]:
    """``(url, job, step)`` of a ``[ckptd+]<url>/<job>/<step>`` id (``url`` an
    ``http(s)://`` server or a ``file:///`` store); the step may be ``latest``
    (None). ``InvalidRequest`` for anything else."""
    text = os.fspath(value)
    if not isinstance(text, str):
        raise InvalidRequest(f"checkpoint id {text!r} is not a string")
    parsed = urlparse(text.removeprefix(_PREFIX))
    if parsed.scheme not in _SCHEMES:
        raise InvalidRequest(f"checkpoint id {text!r} is not <http(s) or file URL>/<job>/<step>")
    parts = parsed.path.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise InvalidRequest(f"checkpoint id {text!r} lacks /<job>/<step> at the end")
    base, job, step_text = parts
    if step_text == "latest":
        step = None
    elif step_text.isdigit() and step_text.isascii():
        step = check_step(int(step_text))
    else:
        raise InvalidRequest(f"checkpoint id {text!r}: step {step_text!r} is not an integer")
    url = urlunparse(parsed._replace(path=base, params="", query="", fragment=""))
    if parsed.scheme == "file" and not base:
        raise InvalidRequest(f"checkpoint id {text!r} names no store path")
    return url, check_job(job), step


def _is_checkpoint_id(value: Any) -> bool:
    try:
        parse_checkpoint_id(value)
    except (InvalidRequest, TypeError):
        return False
    return True


def _bare_step(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return check_step(value)
    if isinstance(value, str) and value.isdigit() and value.isascii():
        return check_step(int(value))
    return None


def _where(url: str | None, job: str | None, token: str | None) -> tuple[str, str, str | None]:
    """A storage class's url, job and token; url and token default to ``CKPTD_URL``
    and ``CKPTD_TOKEN``, and may stay unknown ("") until a checkpoint id names them."""
    if url is None:
        url = os.environ.get("CKPTD_URL") or ""
    if token is None:
        token = os.environ.get("CKPTD_TOKEN") or None
    return url, ("" if job is None else check_job(job)), token


def _require_where(url: str, job: str, who: str) -> None:
    if not url or not job:
        raise InvalidRequest(
            f"{who} has no {'url' if not url else 'job'}: pass url= and job= (or set "
            "CKPTD_URL), or a checkpoint_id such as ckptd+http://host:port/JOB/STEP"
        )


def ckptd_error(exc: BaseException) -> CkptdError | None:
    """The ckptd error inside what ``dcp.save`` / ``dcp.load`` raised: DCP wraps a
    storage error in a ``CheckpointException`` whose ``failures[rank]`` is
    ``(error, traceback)``; the first rank's ckptd error (None when there is none)."""
    if isinstance(exc, CkptdError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for rank in sorted(failures):
            inner = failures[rank]
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, CkptdError):
                return inner
    return None


# -- running the async transport from DCP's synchronous calls ----------------------------


def _run(
    url: str,
    token: str | None,
    work: Callable[[Transport], Coroutine[Any, Any, T]],
    timeout: float | None,
    job: str | None = None,
) -> T:
    """Runs ``work`` with a fresh transport on a private event loop
    (``loop.run_private``: from any thread, DCP's async_save calls from its own,
    inside a running event loop or not). ``Timeout`` after ``timeout`` seconds."""

    async def body() -> T:
        transport = open_transport(url, token, job=job)
        try:
            return await work(transport)
        finally:
            await transport.close()

    try:
        return run_private(body(), timeout, what=f"DCP storage call to {url}",
                           name="ckptd-dcp")
    except CkptdError:
        raise
    except Exception as exc:
        raise CkptdError(f"DCP storage call failed: {type(exc).__name__}: {exc}") from exc


# -- the writer ---------------------------------------------------------------------------


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

    def __repr__(self) -> str:
        return f"Writer({self.url!r}, job={self.job!r}, step={self.step})"

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
        seen: set[str] = set()
        for item in plan.items:  # refuse early, on the rank that holds it, before any byte
            fqn = item.index.fqn
            if fqn in seen:
                raise UnsupportedValue(
                    f"{fqn!r}: several shards of one tensor on one rank are not supported "
                    "(ckptd stores one box per tensor per rank); shard it as a DTensor "
                    "(FSDP2, tensor parallel), one box per rank",
                    name=fqn,
                )
            seen.add(fqn)
            if item.tensor_data is not None:
                dtype_name(item.tensor_data.properties.dtype)
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
            meta_paths[fqn] = _json_path(paths.get(fqn), fqn)
            if item.type == WriteItemType.BYTE_IO:
                resolved = planner.resolve_data(item)
                node = _decode_value(resolved, fqn)
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
            meta={META_KEY: {"version": META_VERSION, "paths": meta_paths}},
        )
        manifest.check()  # a bad manifest fails here, before any byte is sent
        claimer = f"{self.job}/{info.rank}"

        async def work(transport: Transport) -> tuple[int, int]:
            # DCP saves keep no state between calls: each joins the job's timeline
            # as it is when it writes (see Checkpointer for fenced saves).
            epoch = await transport.epoch(self.job)
            stamped = (manifest if not epoch else
                       manifest.model_copy(update={"meta": {**manifest.meta, EPOCH_META: epoch}}))
            sent = await upload_missing(transport, data, claimer)
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
        status = _run(
            self.url,
            self.token,
            lambda t: t.commit(self.job, step, {"producer": "ckptd.client.dcp"}),
            self.timeout,
        )
        if status.state != "committed":
            raise NotCommitted(
                f"{self.job} step {step} did not commit: ranks {status.missing_ranks[:20]} "
                "have no manifest",
                step=step,
                missing_ranks=status.missing_ranks[:50],
            )
        log.info("%s step %d committed (%d ranks)", self.job, step, status.world_size or 0)


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


def _decode_value(data: Any, fqn: str) -> dict[str, Any] | None:
    """The tree node of a non-tensor item, which DCP hands over ``torch.save``-d,
    or None when it is not a plain value (then it is stored as an opaque blob).

    Loaded with ``weights_only=True`` (no code runs) and stored as JSON, never as
    the pickle."""
    if isinstance(data, io.BytesIO):
        data.seek(0)
        try:
            value = torch.load(data, weights_only=True)
        except Exception:
            return None
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
    if tensor.layout != torch.strided:
        raise UnsupportedValue(f"{fqn!r} has layout {tensor.layout}; only dense tensors")
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


# -- the reader ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StoredBox:
    """One stored shard: where its chunks are and what they hold."""

    entry: TensorEntry
    chunk_size: int


@dataclass(slots=True)
class _Index:
    """A committed step as DCP sees it, built from its manifests (never unpickled)."""

    step: int
    world_size: int
    boxes: dict[tuple[str, tuple[int, ...]], _StoredBox] = field(default_factory=dict)
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    # Opaque blobs: the stored box of their bytes, and whether DCP wrote them (then
    # they go back to the planner as written; a Checkpointer's bytes leaf is a value).
    blobs: dict[str, tuple[_StoredBox, bool]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _LoadPlanData:
    job: str
    step: int


class Reader(StorageReader):
    """A DCP ``StorageReader`` of a committed ckptd step (the latest when ``step``
    is None). Loads into any world size: each rank reads only the chunks that
    cover the boxes it asks for, and verifies each against its id. ``url``,
    ``job`` and ``step`` may come from ``dcp.load(checkpoint_id=...)`` as for
    ``Writer``; ``url`` and ``token`` default to ``CKPTD_URL`` and ``CKPTD_TOKEN``.

    ``timeout`` bounds each storage call; ``read_budget`` bounds the bytes of
    shard buffers one batch of ``read_data`` holds."""

    def __init__(
        self,
        url: str | None = None,
        job: str | None = None,
        step: int | None = None,
        token: str | None = None,
        *,
        timeout: float | None = None,
        concurrency: int | None = None,
        read_budget: int = DEFAULT_READ_BUDGET,
    ) -> None:
        super().__init__()
        self.url, self.job, self.token = _where(url, job, token)
        self.step = None if step is None else check_step(step)
        self.timeout = timeout
        self.concurrency = concurrency or knobs.upload_concurrency()
        self.read_budget = int(read_budget)
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self._index: _Index | None = None

    def __repr__(self) -> str:
        return f"Reader({self.url!r}, job={self.job!r}, step={self.step})"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.url.rstrip('/')}/{self.job}/{'latest' if self.step is None else self.step}"

    @property
    def loaded_step(self) -> int | None:
        """The step ``read_metadata`` resolved (the latest, when no step was given)."""
        return None if self._index is None else self._index.step

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.load_id = uuid.uuid4().hex
        self._index = None
        self.bytes_read = 0
        if checkpoint_id is None:
            return
        step = _bare_step(checkpoint_id)
        if step is None:
            self.url, self.job, step = parse_checkpoint_id(checkpoint_id)
        self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata rebuilt from the step's committed manifests: per tensor its
        dtype, global size and every stored box; a bytes entry per plain value."""
        _require_where(self.url, self.job, "Reader")
        index = _run(self.url, self.token, self._read_index, self.timeout, self.job)
        self._index = index
        state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for (fqn, _), box in sorted(index.boxes.items()):
            e = box.entry
            md = state_dict_metadata.get(fqn)
            if md is None:
                md = TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(e.dtype)),
                    size=torch.Size(e.global_shape),
                    chunks=[],
                )
                state_dict_metadata[fqn] = md
            if not isinstance(md, TensorStorageMetadata):
                raise InvalidDocument(f"{fqn!r} is a tensor in one manifest of step "
                                      f"{index.step} and not in another", name=fqn)
            md.chunks.append(ChunkStorageMetadata(torch.Size(e.offsets), torch.Size(e.shape)))
        for fqn in [*index.values, *index.blobs]:
            if isinstance(state_dict_metadata.setdefault(fqn, BytesStorageMetadata()),
                          TensorStorageMetadata):
                raise InvalidDocument(f"{fqn!r} is a tensor in one manifest of step "
                                      f"{index.step} and a value in another", name=fqn)
        return Metadata(
            state_dict_metadata=state_dict_metadata,
            planner_data={fqn: index.paths.get(fqn, (fqn,)) for fqn in state_dict_metadata},
            storage_data=None,
            storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id, load_id=self.load_id),
        )

    async def _read_index(self, transport: Transport) -> _Index:
        step = self.step
        if step is None:
            step = await transport.latest(self.job)
            if step is None:
                raise CheckpointNotFound(
                    f"job {self.job} has no committed checkpoint", job=self.job
                )
        record = await transport.read_commit(self.job, step)
        manifests = await asyncio.gather(
            *(transport.read_manifest(self.job, step, r) for r in range(record.world_size))
        )
        index = _Index(step=step, world_size=record.world_size)
        for m in manifests:
            _index_manifest(index, m)
        return index

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._index is None:
            raise InvalidRequest("Reader.read_metadata must run before set_up_storage_reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank must read the same step; with step=None a commit landing between
        # two ranks' read_metadata could split them. The coordinator's step wins.
        index = self._require_index()
        data = _LoadPlanData(self.job, index.step)
        return [dataclasses.replace(plan, storage_data=data) for plan in plans]

    def _require_index(self) -> _Index:
        if self._index is None:
            raise InvalidRequest("Reader.read_metadata has not run")
        return self._index

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        index = self._require_index()
        info = plan.storage_data
        if isinstance(info, _LoadPlanData) and (info.job, info.step) != (self.job, index.step):
            raise Conflict(
                f"ranks disagree on the checkpoint: the coordinator loads {info.job} step "
                f"{info.step}, this rank {self.job} step {index.step}; pass step= to Reader",
                step=info.step,
            )
        by_box: dict[tuple[str, tuple[int, ...]], list[ReadItem]] = {}
        for req in plan.items:
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO and fqn in index.blobs:
                planner.load_bytes(req, io.BytesIO(self._read_blob(*index.blobs[fqn])))
                continue
            if req.type == LoadItemType.BYTE_IO:
                node = index.values.get(fqn)
                if node is None:
                    raise RestoreError(f"{fqn!r} is not a value of step {index.step}")
                buf = io.BytesIO()
                # Our own bytes of a JSON value, made here for the planner's torch.load:
                # nothing from the store is ever unpickled.
                torch.save(unflatten(node, {}), buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            key = (fqn, tuple(int(o) for o in (req.storage_index.offset or ())))
            if key not in index.boxes:
                raise RestoreError(
                    f"step {index.step} holds no shard of {fqn!r} at {list(key[1])}",
                    entries=[fqn],
                )
            by_box.setdefault(key, []).append(req)

        batch: list[tuple[_StoredBox, list[ReadItem]]] = []
        held = 0
        for key, reqs in by_box.items():
            box = index.boxes[key]
            if batch and held + box.entry.nbytes > self.read_budget:
                self._read_batch(batch, planner)
                batch, held = [], 0
            batch.append((box, reqs))
            held += box.entry.nbytes
        if batch:
            self._read_batch(batch, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_blob(self, box: _StoredBox, written_by_dcp: bool) -> bytes:
        """An opaque blob's bytes, each chunk verified. A blob DCP wrote goes back as
        written (DCP's planner, not ckptd, decides how to read it); a Checkpointer's
        bytes leaf is a value, so it is ``torch.save``-d for the planner like one."""
        e = box.entry
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        view = byte_view(buf)
        wanted = WantedChunks()
        for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, box.chunk_size), strict=True):
            wanted.add(cid, view[a:b], e.name)
        step = self._require_index().step

        async def work(transport: Transport) -> int:
            return await _fetch_chunks(transport, wanted, self.concurrency, step)

        self.bytes_read += _run(self.url, self.token, work, self.timeout, self.job)
        raw = buf.numpy().tobytes()
        if written_by_dcp:
            return raw
        out = io.BytesIO()
        torch.save(raw, out)  # our own bytes of a bytes value, for the planner's torch.load
        return out.getvalue()

    def _read_batch(
        self, batch: list[tuple[_StoredBox, list[ReadItem]]], planner: LoadPlanner
    ) -> None:
        """Fetches and verifies the chunks that cover the requested sub-boxes of a
        batch of stored shards, then copies each sub-box into its target."""
        buffers: list[torch.Tensor] = []
        wanted = WantedChunks()  # chunk id -> destinations
        for box, reqs in batch:
            e = box.entry
            buf = torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype))
            buffers.append(buf)
            view = byte_view(buf)
            spans = list(chunk_spans(e.nbytes, box.chunk_size))
            needed: set[int] = set()
            for req in reqs:
                needed.update(_chunks_covering(e, box.chunk_size, req))
            for i in sorted(needed):
                a, b = spans[i]
                wanted.add(e.chunks[i], view[a:b], e.name)
        step = self._require_index().step

        async def work(transport: Transport) -> int:
            return await _fetch_chunks(transport, wanted, self.concurrency, step)

        self.bytes_read += _run(self.url, self.token, work, self.timeout, self.job)
        for (box, reqs), buf in zip(batch, buffers, strict=True):
            for req in reqs:
                source = buf
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    source = source.narrow(d, int(o), int(n))
                target = planner.resolve_tensor(req).detach()
                if target.size() != source.size():
                    raise RestoreError(
                        f"{box.entry.name!r}: the target slice is {list(target.size())}, the "
                        f"stored slice {list(source.size())}",
                        entries=[box.entry.name],
                    )
                target.copy_(source)
                planner.commit_tensor(req, target)


def _chunks_covering(entry: TensorEntry, chunk_size: int, req: ReadItem) -> list[int]:
    """Indices of the chunks of a C-contiguous shard that hold a sub-box of it (the
    restore's geometry, ``ckptd.geometry.covering_chunks``)."""
    offsets = [int(o) for o in req.storage_offsets]
    lengths = [int(n) for n in req.lengths]
    if len(offsets) != len(entry.shape) or len(lengths) != len(entry.shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, entry.shape, strict=True)
    ):
        raise RestoreError(
            f"{entry.name!r}: asked for {offsets}+{lengths} of a shard of shape {entry.shape}",
            entries=[entry.name],
        )
    if entry.nbytes == 0 or any(n == 0 for n in lengths):
        return []
    hi = [o + n for o, n in zip(offsets, lengths, strict=True)]
    return covering_chunks(entry.shape, itemsize(entry.dtype), chunk_size, offsets, hi)


async def _fetch_chunks(transport: Transport, wanted: WantedChunks, concurrency: int,
                        step: int) -> int:
    """Each wanted chunk through the restore engine (``ChunkFetcher``): from the
    local cache directory (``CKPTD_CACHE_DIR``) or the store (mapped in place for
    a ``file://`` one), verified against its id, then delivered to every
    destination; the bytes read. A chunk no source had right raises the engine's
    typed error naming its entries."""
    cache = knobs.cache_dir()
    sources: list[Source] = [DirectoryCacheSource(cache)] if cache else []
    sources.append(LocalStoreSource.of(transport) or StoreSource(transport))
    fetcher = ChunkFetcher(sources, concurrency)
    try:
        found = await fetcher.locate_all(wanted)
        if fetcher.failed:
            raise failure(fetcher, wanted, step)
        await deliver(found, wanted)
    finally:
        fetcher.close()
    return sum(fetcher.bytes_from.values())


def _index_manifest(index: _Index, manifest: RankManifest) -> None:
    """Adds one rank manifest's boxes and values to the index.

    A DCP-written manifest has a flat tree ``{fqn: node}``; another (a
    ``Checkpointer`` save) is walked as DCP flattens a state dict, so its dotted
    tensor names are DCP's fully qualified names."""
    entries = {e.name: e for e in manifest.entries}
    dcp_meta = manifest.meta.get(META_KEY)
    leaves: list[tuple[str, tuple[str | int, ...], dict[str, Any]]] = []
    if isinstance(dcp_meta, dict):
        paths = dcp_meta.get("paths") or {}
        for fqn, node in manifest.tree.get("dict", []):
            path = paths.get(fqn)
            leaves.append((str(fqn), tuple(path) if isinstance(path, list) else (str(fqn),), node))
    else:
        _walk_tree(manifest.tree, (), leaves)
    for fqn, path, node in leaves:
        index.paths.setdefault(fqn, path)
        if set(node) == {"bytes"}:
            index.blobs.setdefault(fqn, (_StoredBox(entries[node["bytes"]],
                                                    manifest.chunk_size),
                                         isinstance(dcp_meta, dict)))
            continue
        if set(node) != {"tensor"}:
            index.values.setdefault(fqn, node)  # replicas of a value: the lowest rank's
            continue
        e = entries[node["tensor"]]
        if e.placement == "local" and manifest.world_size > 1:
            log.debug("skipping rank-local entry %r of rank %d", e.name, manifest.rank)
            continue
        # Replicated entries and HSDP replicas share a box: one is enough to read.
        index.boxes.setdefault((fqn, tuple(e.offsets)), _StoredBox(e, manifest.chunk_size))


def _walk_tree(
    node: dict[str, Any],
    path: tuple[str | int, ...],
    leaves: list[tuple[str, tuple[str | int, ...], dict[str, Any]]],
) -> None:
    """DCP's traversal of a state dict, over a tree: mappings are always entered,
    lists only when they hold a tensor or a mapping; everything else is a leaf."""
    ((kind, body),) = node.items()
    if kind == "dict":
        for key, child in body:
            _walk_tree(child, (*path, str(key)), leaves)
    elif kind in ("list", "tuple") and _holds_tensor_or_dict(node):
        for i, child in enumerate(body):
            _walk_tree(child, (*path, i), leaves)
    elif path:
        leaves.append((".".join(map(str, path)), path, node))


def _holds_tensor_or_dict(node: dict[str, Any]) -> bool:
    ((kind, body),) = node.items()
    if kind in ("tensor", "dict"):
        return True
    if kind in ("list", "tuple"):
        return any(_holds_tensor_or_dict(child) for child in body)
    return False


__all__ = [
    "Reader",
    "WriteSummary",
    "Writer",
    "checkpoint_id",
    "parse_checkpoint_id",
]
