"""DCP's ``StorageReader`` on ckptd (``Reader``): ``Metadata`` rebuilt from the
committed manifests, and any sub-box of a stored shard read through the restore
engine from the chunks that cover it."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

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
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptd import knobs
from ckptd.dtypes import itemsize
from ckptd.errors import (
    CheckpointNotFound,
    Conflict,
    InvalidDocument,
    InvalidRequest,
    RestoreError,
)
from ckptd.format import (
    RankManifest,
    TensorEntry,
    check_step,
)
from ckptd.geometry import covering_chunks
from ckptd.hashing import chunk_spans
from ckptd.knobs import MiB

from ..dtypes import byte_view, torch_dtype
from ..peer import PeerClient
from ..restore.fetch import ChunkFetcher, WantedChunks, deliver, failure
from ..restore.fill import unflatten
from ..restore.plan import fetch_restore_plan
from ..restore.sources import (
    DirectoryCacheSource,
    LocalPoolSource,
    LocalStoreSource,
    PeerSource,
    Source,
    StoreSource,
)
from ..transport import Transport
from .target import (
    META_KEY,
    _bare_step,
    _is_checkpoint_id,
    _require_where,
    _run,
    _where,
    parse_checkpoint_id,
)

log = logging.getLogger(__name__)


# Shard buffers one ``read_data`` batch may hold at once (bytes).
DEFAULT_READ_BUDGET = 256 * MiB


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
    # Live peers holding each chunk (from the server's restore plans) and the job's
    # peer token they require: the peer tier, as a Checkpointer's restore has it.
    peers: dict[str, list[str]] = field(default_factory=dict)
    peer_token: str | None = None


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

    Chunks come through the restore engine's tiers, as for ``Checkpointer.restore``:
    this rank's staging pool, the cache directory, live peers, the store;
    ``bytes_from`` says how many bytes each gave (``bytes_read``: all of them).

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
        self.bytes_from: dict[str, int] = {}
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
        self.bytes_from = {}
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
        for r in range(record.world_size):  # no plan (a file:// store): no peers
            _, peers, _, token = await fetch_restore_plan(transport, self.job, r, step)
            index.peer_token = index.peer_token or token
            for cid, urls in peers.items():
                have = index.peers.setdefault(cid, [])
                have.extend(u for u in urls if u not in have)
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

    def _count(self, bytes_from: dict[str, int]) -> None:
        for tier, n in bytes_from.items():
            self.bytes_from[tier] = self.bytes_from.get(tier, 0) + n
        self.bytes_read += sum(bytes_from.values())

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
        index = self._require_index()

        async def work(transport: Transport) -> dict[str, int]:
            return await _fetch_chunks(transport, wanted, self.concurrency, index, self.job)

        self._count(_run(self.url, self.token, work, self.timeout, self.job))
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
        index = self._require_index()

        async def work(transport: Transport) -> dict[str, int]:
            return await _fetch_chunks(transport, wanted, self.concurrency, index, self.job)

        self._count(_run(self.url, self.token, work, self.timeout, self.job))
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
                        index: _Index, job: str) -> dict[str, int]:
    """Each wanted chunk through the restore engine's tiers (``ChunkFetcher``): this
    rank's staging pool, the local cache directory (``CKPTD_CACHE_DIR``), live
    peers, then the store (mapped in place for a ``file://`` one); each verified
    against its id, then delivered to every destination; the bytes read. A chunk
    no source had right raises the engine's typed error naming its entries."""
    sources: list[Source] = []
    entries = [(box.entry, box.chunk_size) for box in index.boxes.values()]
    try:  # a pool we cannot read is a pool we do not have
        pool = LocalPoolSource.open(job, _this_rank(), entries)
    except Exception as exc:
        log.warning("cannot read this rank's staging pool of %s: %s", job, exc)
        pool = None
    if pool is not None:
        sources.append(pool)
    cache = knobs.cache_dir()
    if cache:
        sources.append(DirectoryCacheSource(cache))
    client = None
    if index.peers:
        client = PeerClient(index.peer_token)
        sources.append(PeerSource(index.peers, client))
    sources.append(LocalStoreSource.of(transport) or StoreSource(transport))
    fetcher = ChunkFetcher(sources, concurrency)
    try:
        found = await fetcher.locate_all(wanted)
        if fetcher.failed:
            raise failure(fetcher, wanted, index.step)
        await deliver(found, wanted)
    finally:
        fetcher.close()
        if client is not None:
            client.close()
    return dict(fetcher.bytes_from)


def _this_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
