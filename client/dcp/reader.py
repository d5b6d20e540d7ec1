"""DCP's ``StorageReader`` on ckptd (``Reader``): ``Metadata`` rebuilt from the
committed manifests, and any sub-box of a stored shard read through the restore
engine from the chunks that cover it."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
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
    CkptdError,
    Conflict,
    InvalidDocument,
    InvalidRequest,
    NotFound,
    RestoreError,
    Unavailable,
    UnsupportedValue,
)
from ckptd.format import (
    TensorEntry,
    check_step,
)
from ckptd.hashing import chunk_spans
from ckptd.knobs import MiB

from ..dtypes import byte_view, torch_dtype
from ..peer import PeerClient
from ..reach import reach
from ..restore.failure import failure
from ..restore.fetch import ChunkFetcher, WantedChunks, deliver
from ..restore.fill import unflatten
from ..restore.geometry import Box
from ..restore.layout import fill_from_entry, fits_in_place
from ..restore.memory import fresh_tensor
from ..restore.plan import load_step
from ..restore.sources import (
    DirectoryCacheSource,
    LocalPoolSource,
    LocalStoreSource,
    PeerSource,
    Source,
    StoreSource,
)
from ..step_import import refused_by
from ..transport import HttpTransport, Transport
from .index import StepIndex, StoredBox, index_manifest
from .target import (
    _bare_step,
    _is_checkpoint_id,
    _require_where,
    _run,
    _where,
    parse_checkpoint_id,
)
from .values import give_value
from .writer import load_value

log = logging.getLogger(__name__)


def _no_checkpoint(exc: NotFound, job: str | None) -> CheckpointNotFound:
    """``exc`` as ``CheckpointNotFound``: a store not there yet (a first run's resume
    over ``file://``, before any save made it) holds no checkpoint either."""
    if isinstance(exc, CheckpointNotFound):
        return exc
    return CheckpointNotFound(str(exc), **{"job": job, **exc.detail})


# Fresh memory (bytes) one ``read_data`` batch may hold at once for chunks that do
# not land straight in their targets.
DEFAULT_READ_BUDGET = 256 * MiB


# Chunks one batch fetches at most: a ``file://`` store's (or the cache's) chunk
# files stay mapped until their batch is delivered, and a process may hold only so
# many maps (``vm.max_map_count``, 65530 by default).
BATCH_CHUNKS = 4096


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

    ``timeout`` bounds each storage call; ``read_budget`` bounds the fresh memory
    one batch of ``read_data`` holds (chunks that are not landed straight in their
    target tensors). A step named (here or by ``reset``) that is not committed, or
    a job with no committed step when none is named, is ``CheckpointNotFound`` at
    once (a first run catches it and starts from scratch; make the reader when
    loading, not before the job's first save), as is a ``file://`` path with no
    store."""

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
        # Twice a restore's: over HTTP the store tier sends the reads that wait
        # together (two requests at once per replica), so more waiting is fewer requests.
        self.concurrency = concurrency or 2 * knobs.restore_concurrency()
        self.read_budget = int(read_budget)
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self.bytes_from: dict[str, int] = {}
        self._index: StepIndex | None = None
        # Why the last read_metadata failed: DCP replaces that error with its own
        # AssertionError("metadata is None; ..."), and ckptd_error finds it here.
        self.metadata_error: CkptdError | None = None
        self._check_step()

    def _check_step(self) -> None:
        """The step named (here, or by ``dcp.load(checkpoint_id=...)``'s ``reset``)
        must be committed, and without one the job must have a committed step:
        ``CheckpointNotFound`` now, before ``dcp.load`` begins. From ``read_metadata``
        torch first logs it as a warning with its traceback ("Global metadata is not
        found. Falling back to rank local metadata."), then raises its own error. One
        small read (the commit record, or the latest step); which step is the latest
        is resolved when the load reads it. Before it, a server is asked as a new
        ``Checkpointer`` asks it (``reach``): a token it refuses, or a program that is
        not a ckptd server, is raised now in the Checkpointer's words."""
        if not self.url or not self.job:
            return
        job, step, url = self.job, self.step, self.url
        refused: list[CkptdError] = []

        async def read(transport: Transport) -> None:
            if isinstance(transport, HttpTransport):
                # As a Checkpointer is made (``reach``): a refused token, a program that
                # is not a ckptd server, a TLS mismatch are said now, in its words, the
                # same on every rank; a server that does not answer is left to the load.
                try:
                    await reach(transport, job, 0.0)
                except Unavailable:
                    raise
                except CkptdError as exc:
                    refused.append(exc)
                    return
            if step is not None:
                await transport.read_commit(job, step)
            elif (await transport.restorable(job))[0] is None:
                # A first run's resume, the usual case: say what to do about it.
                raise CheckpointNotFound(
                    f"job {job} has no committed checkpoint at {url}: nothing is saved "
                    "yet (a first run starts from scratch: catch CheckpointNotFound), "
                    "or the job name or url is wrong", job=job)

        try:
            _run(self.url, self.token, read, self.timeout, self.job, create=False)
        except NotFound as exc:  # (the same answer on every rank)
            raise _no_checkpoint(exc, job) from None
        except CkptdError as exc:
            # Not known missing (a server that did not answer, ...): ``reset`` runs on
            # each rank before DCP's first collective, so one rank raising here would
            # leave the others waiting in it. ``read_metadata`` says it, inside DCP's
            # error exchange, as before.
            log.debug("checking %s of %s before the load: %s",
                      "the latest step" if step is None else f"step {step}", job, exc)
        if refused:  # (its frames are the private loop's: the message says all there is)
            raise refused[0].with_traceback(None) from None

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
        self._check_step()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """DCP's metadata rebuilt from the step's committed manifests: per tensor its
        dtype, global size and every stored box; a bytes entry per plain value."""
        # (Not named **kwargs: DCP asks a reader whose read_metadata takes "kwargs" a
        # second time, for a rank's own metadata, when the first call failed; ckptd's
        # is global, and that second read logged a second traceback.)
        self.metadata_error = None
        try:
            _require_where(self.url, self.job, "Reader")
            index = _run(self.url, self.token, self._read_index, self.timeout, self.job,
                         create=False)
        except NotFound as exc:
            self.metadata_error = err = _no_checkpoint(exc, self.job)
            raise err from None
        except CkptdError as exc:
            self.metadata_error = exc
            raise
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

    async def _read_index(self, transport: Transport) -> StepIndex:
        # One request to a server (its step plan: the commit, every rank's manifest
        # and the live peers holding the step), each manifest checked against the
        # commit; a file:// store is read directly.
        plan = await load_step(transport, self.job, _this_rank(), self.step)
        if plan.fallback:
            log.warning("loading step %d of %s, not the latest: %s", plan.step, self.job,
                        "; ".join(plan.fallback))
        index = StepIndex(step=plan.step, world_size=plan.world_size, peers=plan.peers,
                       peer_token=plan.peer_token)
        for r in range(plan.world_size):
            index_manifest(index, plan.manifests[r])
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

    def _require_index(self) -> StepIndex:
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
        reads: list[tuple[StoredBox, ReadItem]] = []
        blobs: list[tuple[ReadItem, StoredBox, bool]] = []
        for req in plan.items:
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO and fqn in index.blobs:
                blobs.append((req, *index.blobs[fqn]))
                continue
            if req.type == LoadItemType.BYTE_IO:
                node = index.values.get(fqn)
                if node is None:
                    raise RestoreError(f"{fqn!r} is not a value of step {index.step}")
                # A JSON value: placed, or as bytes of ckptd's own (values.py).
                give_value(planner, req, unflatten(node, {}))
                continue
            key = (fqn, tuple(int(o) for o in (req.storage_index.offset or ())))
            if key not in index.boxes:
                raise RestoreError(
                    f"step {index.step} holds no shard of {fqn!r} at {list(key[1])}",
                    entries=[fqn],
                )
            box = index.boxes[key]
            _check_read(box.entry, req)
            reads.append((box, req))
        if reads or blobs:
            async def work(transport: Transport) -> dict[str, int]:
                return await self._load(transport, index, reads, blobs, planner)

            self._count(_run(self.url, self.token, work, self.timeout, self.job,
                             create=False))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _count(self, bytes_from: dict[str, int]) -> None:
        for tier, n in bytes_from.items():
            self.bytes_from[tier] = self.bytes_from.get(tier, 0) + n
        self.bytes_read += sum(bytes_from.values())

    async def _load(
        self,
        transport: Transport,
        index: StepIndex,
        reads: list[tuple[StoredBox, ReadItem]],
        blobs: list[tuple[ReadItem, StoredBox, bool]],
        planner: LoadPlanner,
    ) -> dict[str, int]:
        """Every read item through one set of sources (one transport, one pool map):
        chunks land straight in the planner's target tensors where their bytes are
        the target's bytes, else in fresh memory (at most ``read_budget`` bytes of it
        per batch) and are copied from there. DCP's load writes its targets as it
        goes, as ``FileSystemReader`` does: a failed load leaves them partly loaded."""
        fetcher, peer_client = _fetcher(transport, index, self.job, self.concurrency)
        batch = _Batch()
        try:
            for req, box, written_by_dcp in blobs:
                batch.fresh += _plan_blob(batch, req, box, written_by_dcp)
            for box, req in reads:
                target = planner.resolve_tensor(req).detach()
                batch.fresh += _plan_read(batch.wanted, box, req, target)
                batch.reads.append((req, target))
                if batch.fresh >= self.read_budget or len(batch.wanted.chunks) >= BATCH_CHUNKS:
                    await _fetch_batch(fetcher, batch, index.step, planner)
                    batch = _Batch()
            await _fetch_batch(fetcher, batch, index.step, planner)
        finally:
            fetcher.close()
            if peer_client is not None:
                peer_client.close()
        return dict(fetcher.bytes_from)


@dataclass(slots=True)
class _Batch:
    """Read items whose chunks are fetched together, and the fresh bytes they hold."""

    wanted: WantedChunks = field(default_factory=WantedChunks)
    reads: list[tuple[ReadItem, torch.Tensor]] = field(default_factory=list)
    blobs: list[tuple[ReadItem, torch.Tensor, bool]] = field(default_factory=list)
    fresh: int = 0


def _check_read(entry: TensorEntry, req: ReadItem) -> None:
    """A read item must ask for a sub-box of the stored shard."""
    offsets = [int(o) for o in req.storage_offsets]
    lengths = [int(n) for n in req.lengths]
    if len(offsets) != len(entry.shape) or len(lengths) != len(entry.shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, entry.shape, strict=True)
    ):
        raise RestoreError(
            f"{entry.name!r}: asked for {offsets}+{lengths} of a shard of shape {entry.shape}",
            entries=[entry.name],
        )


def _plan_read(wanted: WantedChunks, box: StoredBox, req: ReadItem,
               target: torch.Tensor) -> int:
    """Plans one read item into ``target`` with the restore's layout
    (``fill_from_entry``): its chunks straight into the target when the item is the
    whole stored shard and the target holds its bytes (a dense CPU tensor of its
    dtype), else landed in fresh memory and copied (the fresh bytes it needs)."""
    e = box.entry
    lengths = tuple(int(n) for n in req.lengths)
    if tuple(target.size()) != lengths:
        raise RestoreError(
            f"{e.name!r}: the target slice is {list(target.size())}, the stored slice "
            f"{list(lengths)}",
            entries=[e.name],
        )
    if math.prod(lengths) == 0:
        return 0  # nothing to read
    needed: Box = (tuple(o + int(s) for o, s in zip(e.offsets, req.storage_offsets,
                                                    strict=True)), lengths)
    dtype = torch_dtype(e.dtype)
    whole = needed == (tuple(e.offsets), tuple(e.shape))
    if whole and not fits_in_place(target, dtype, lengths):
        buf = fresh_tensor(lengths, dtype)  # then copied (and cast) into the target
        fill_from_entry(wanted, e.name, buf, needed, e, box.chunk_size, False)
        wanted.copies.append((target, buf))
        return e.nbytes
    n = fill_from_entry(wanted, e.name, target, needed, e, box.chunk_size, whole)
    # Another box: the chunks covering it land in fresh memory, then are sliced.
    return 0 if whole else n * itemsize(e.dtype) + 2 * box.chunk_size


def _plan_blob(batch: _Batch, req: ReadItem, box: StoredBox, written_by_dcp: bool) -> int:
    e = box.entry
    buf = torch.empty(e.nbytes, dtype=torch.uint8)
    view = byte_view(buf)
    for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, box.chunk_size), strict=True):
        batch.wanted.add(cid, view[a:b], e.name)
    batch.blobs.append((req, buf, written_by_dcp))
    return e.nbytes


async def _fetch_batch(fetcher: ChunkFetcher, batch: _Batch, step: int,
                       planner: LoadPlanner) -> None:
    """Fetches and verifies a batch's chunks, delivers them, and hands the planner
    its tensors and blobs."""
    if batch.wanted.chunks:
        # Chunks may land in the targets as they verify (DCP writes its targets as it
        # goes); every chunk is still verified before anything reads it.
        found = await fetcher.locate_all(batch.wanted, atomic=False)
        if fetcher.failed:
            raise failure(fetcher, batch.wanted, step)
        await deliver(found, batch.wanted, prefilled=fetcher.prefilled, sent=fetcher.sent)
    for req, buf, written_by_dcp in batch.blobs:
        give_value(planner, req, _blob_value(buf, written_by_dcp, req.storage_index.fqn,
                                             step))
    for req, target in batch.reads:
        planner.commit_tensor(req, target)
    for source in fetcher.sources:
        if isinstance(source, DirectoryCacheSource):
            source.close()  # its maps (it maps again on the next batch's first view)


def _blob_value(buf: torch.Tensor, written_by_dcp: bool, fqn: str, step: int) -> Any:
    """An opaque blob's value for the planner (``values.py``): a blob DCP wrote (a
    ``torch.save`` of a value that is no plain JSON) is the store's content, read
    here with ``weights_only=True`` (types the user registered with
    ``torch.serialization.add_safe_globals`` included); a Checkpointer's bytes leaf
    is a value itself."""
    raw = buf.numpy().tobytes()
    value: Any = raw
    if written_by_dcp:
        try:
            value = load_value(io.BytesIO(raw))
        except Exception as exc:  # (UnpicklingError, or any failure of a bad pickle)
            # Not torch's message: it speaks of a file and of loading it anyway, with
            # terminal escape codes in it; what it refused, in a few words.
            raise UnsupportedValue(
                f"{fqn!r} of step {step} is stored as a pickle that weights_only loading "
                f"refuses ({refused_by(exc)}), and ckptd unpickles nothing else from a "
                "store: save that value as a tensor or a plain value instead, or, if you "
                "trust its type, register it with torch.serialization.add_safe_globals "
                "(Checkpointer.restore gives the stored bytes as they are)",
                name=fqn, step=step) from None
    return value


def _fetcher(transport: Transport, index: StepIndex, job: str,
             concurrency: int) -> tuple[ChunkFetcher, PeerClient | None]:
    """The restore engine's fetcher over its tiers, as for ``Checkpointer.restore``:
    this rank's staging pool, the local cache directory (``CKPTD_CACHE_DIR``), live
    peers, then the store (mapped in place for a ``file://`` one). Every chunk is
    verified against its id; a chunk no source had right is the engine's typed
    error naming its entries."""
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
    return ChunkFetcher(sources, concurrency), client


def _this_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
