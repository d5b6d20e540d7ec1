"""``ckptd export --safetensors``: a committed step as Hugging Face sharded
safetensors files and their ``model.safetensors.index.json``.

Streamed: each file is written in windows of a few tens of MiB, in file order.
A tensor whose stored boxes are runs of its bytes (whole rows: replicated,
``Shard(0)``, 1-D) is its chunks in order; any other layout (``Shard(1)``,
tensor-parallel columns) is assembled slab of rows by slab from the boxes under
it. A chunk that is a file on this host (a ``file://`` store, the cache
directory) is read a MiB at a time into a small buffer, hashed there and written
from it while the piece is in the core's cache; a file that does not hash to its
chunk is written again from another tier. The others (over HTTP, slabs, a local file
that did not verify) are fetched by the restore engine's fetcher (its tiers,
its typed failures), verified and landed in a window, which is written while
the next one fills. Memory stays at two windows (and a slab's landing) plus a
piece per thread, whatever the step's size.

Files are written into a staging directory (``DIR.partial-<hex>``, see
``export_staging``), the index last, and it is renamed to ``DIR`` once all are
complete. A failed or interrupted export leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptd import knobs
from ckptd.errors import CkptdError, InvalidRequest
from ckptd.hashing import StreamingHasher, chunk_spans
from ckptd.knobs import MiB, human_bytes

from ...dtypes import byte_view, torch_dtype
from ...endpoint import endpoint
from ...export_staging import check_target, discard, publish, stage, write_advice
from ...loop import in_thread, run_private, spread
from ...restore.failure import failure
from ...restore.fetch import ChunkFetcher, WantedChunks, deliver
from ...restore.layout import fill_from_entry
from ...restore.sources import (
    DirectoryCacheSource,
    LocalStoreSource,
    Source,
    StoreSource,
)
from ...transport import Transport, open_transport, read_step
from .layout import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    FilePlan,
    GlobalTensor,
    Placed,
    global_tensors,
    index_bytes,
    kept_metadata,
    parse_size,
    plan_files,
    prefixes,
    run_start,
)

log = logging.getLogger(__name__)

WINDOW = 64 * MiB  # bytes of a file filled, then written, at once (two in memory)
# Bytes of a chunk file on this host read, hashed and written at a time, on each
# thread: still in the core's cache when hashed and written. (Mapping each chunk
# file, hashing the map and writing from it cost 25% more CPU and 20% more time.)
PIECE = MiB
# Bytes of chunk files on this host hashed and written from their maps between two
# progress reports (8 maps at a time whatever this is).
LOCAL_BATCH = 512 * MiB

# (bytes written, bytes in all)
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class SafetensorsExport:
    """What an export wrote."""

    step: int
    tensors: int
    files: list[str]  # file names, in order (the index not included)
    nbytes: int  # the tensors' bytes
    seconds: float
    directory: str
    skipped_local: list[str]  # rank-local entries, not global tensors
    bytes_from: dict[str, int]  # by tier: cache, store


def export_safetensors(
    url: str,
    job: str,
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    token: str | None = None,
    max_shard_size: int | float | str = DEFAULT_MAX_SHARD_SIZE,
    only: str | Sequence[str] = (),
    strip: str = "",
    exclude: str | Sequence[str] = (),
    on_bytes: Progress | None = None,
    transport: Transport | None = None,
    window: int | None = None,
) -> SafetensorsExport:
    """Writes step ``step`` (default: latest) of ``job`` to ``directory`` (new, or
    empty) as safetensors files of at most ``max_shard_size`` bytes each (a tensor
    larger than that alone in its file), with ``model.safetensors.index.json``.

    ``only``: the tensors whose names start with this prefix, or one of these
    (``"model."``, ``["model.", "lm_head."]``); ``exclude``: then not those whose names
    start with this prefix, or one of these; ``strip``: a prefix removed from the
    names in the files (refused when no exported name has it).
    ``on_bytes(done, total)`` follows the bytes written."""
    limit = parse_size(max_shard_size)
    wanted, unwanted = prefixes(only), prefixes(exclude, "exclude")
    target = Path(directory)
    check_target(target)
    url, token = endpoint(url, token)

    async def body() -> SafetensorsExport:
        own = transport is None
        t = (open_transport(url, token, job=job, create=False) if transport is None
             else transport)
        try:
            return await _export(t, job, step, target, limit, (wanted, unwanted), strip,
                                 on_bytes, window)
        finally:
            if own:
                await t.close()

    return run_private(body(), None, what=f"exporting {job}", name="ckptd-export")


async def _export(transport: Transport, job: str, step: int | None, target: Path,
                  limit: int, which: tuple[tuple[str, ...], tuple[str, ...]], strip: str,
                  on_bytes: Progress | None, window: int | None) -> SafetensorsExport:
    t0 = time.perf_counter()
    step, manifests = await read_step(transport, job, step)
    only, exclude = which
    selection = global_tensors(manifests, only, strip, exclude)
    if not selection.tensors:
        raise InvalidRequest(_nothing_selected(job, step, only, exclude,
                                               selection.skipped_other))
    # (what an import kept of its files' __metadata__ goes back; ckptd's keys are ours)
    metadata = {**kept_metadata(manifests), "format": "pt", "ckptd.job": job,
                "ckptd.step": str(step)}
    plans = plan_files(selection.tensors, limit, metadata)
    biggest_chunk = max(b.chunk_size for t in selection.tensors for b in t.boxes) \
        if any(t.boxes for t in selection.tensors) else 0
    size = window or max(biggest_chunk, min(WINDOW, max(MiB, limit // 4)))
    total = sum(p.size for p in plans)
    try:
        staging = stage(target)
    except OSError as exc:
        if target.is_dir():  # (an empty directory given: refused as its files would be)
            raise _refused(target, plans[0], exc) from None
        raise InvalidRequest(f"cannot create {target}: {exc.strerror or exc}; "
                             f"{write_advice(exc)}") from None
    writer = _Writer(transport, step, size, on_bytes, total)
    try:
        _check_room(staging.path, target, total)
        for plan in plans:
            try:
                await writer.write_file(staging.path / plan.filename, plan)
            except CkptdError:  # (a store's errors are OSErrors too: theirs to tell)
                raise
            except OSError as exc:  # the target's: a full disk, a read-only directory
                raise _refused(target, plan, exc) from None
        (staging.path / INDEX_NAME).write_bytes(index_bytes(plans))
        publish(staging, INDEX_NAME)
    except BaseException:
        discard(staging)
        raise
    finally:
        writer.close()
    nbytes = sum(t.nbytes for t in selection.tensors)
    result = SafetensorsExport(step, len(selection.tensors), [p.filename for p in plans],
                               nbytes, time.perf_counter() - t0, str(target),
                               selection.skipped_local, writer.bytes_from())
    log.info("exported step %d of %s: %d tensors, %d bytes in %d files in %.2f s", step, job,
             result.tensors, nbytes, len(plans), result.seconds)
    return result


@dataclass(frozen=True, slots=True)
class _Chunk:
    """A stored chunk whose bytes are bytes ``[at, at + size)`` of a file's data."""

    cid: str
    name: str
    at: int
    size: int


@dataclass(frozen=True, slots=True)
class _Slab:
    """Rows ``[r0, r0 + rows)`` of a tensor whose boxes are not runs of its bytes,
    assembled from the boxes under them; they are bytes ``[at, at + size)``."""

    tensor: GlobalTensor
    r0: int
    rows: int
    at: int
    size: int


Piece = _Chunk | _Slab


def pieces(plan: FilePlan, window: int) -> list[Piece]:
    """A file's data, in order, as stored chunks and assembled slabs."""
    out: list[Piece] = []
    for p in plan.placed:
        t = p.tensor
        if t.contiguous:
            out.extend(_chunks_of(p))
            continue
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
        per = max(1, window // max(1, row))
        for r0 in range(0, t.shape[0], per):
            rows = min(per, t.shape[0] - r0)
            out.append(_Slab(t, r0, rows, p.begin + r0 * row, rows * row))
    return out


def _chunks_of(p: Placed) -> list[_Chunk]:
    t = p.tensor
    item = t.nbytes // max(1, math.prod(t.shape)) if math.prod(t.shape) else 0
    out = []
    for box in t.boxes:
        e = box.entry
        start = p.begin + run_start(e.offsets, t.shape) * item
        for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, box.chunk_size), strict=True):
            out.append(_Chunk(cid, t.source, start + a, b - a))
    return out


class _Writer:
    """Fills windows of a file from the store, verified, and writes them, the
    next window filling while the last one is written."""

    def __init__(self, transport: Transport, step: int, window: int,
                 on_bytes: Progress | None, total: int) -> None:
        sources: list[Source] = []
        cache = knobs.cache_dir()
        if cache:
            sources.append(DirectoryCacheSource(cache))
        sources.append(LocalStoreSource.of(transport) or StoreSource(transport))
        self.fetcher = ChunkFetcher(sources, 2 * knobs.restore_concurrency())
        # Chunk files on this host, written from their maps (in tier order).
        self.local_sources = [s for s in sources if isinstance(s, DirectoryCacheSource)]
        self.bytes_local: dict[str, int] = {s.tier: 0 for s in self.local_sources}
        self.workers = max(1, min(8, os.cpu_count() or 1))
        self.step = step
        self.window = window
        self.buffers = [torch.empty(window, dtype=torch.uint8) for _ in range(2)]
        self.on_bytes = on_bytes
        self.total = total
        self.done = 0

    def close(self) -> None:
        self.fetcher.close()
        self.buffers = []

    def bytes_from(self) -> dict[str, int]:
        """Bytes read, by tier."""
        out = dict(self.fetcher.bytes_from)
        for tier, n in self.bytes_local.items():
            out[tier] = out.get(tier, 0) + n
        return {tier: n for tier, n in out.items() if n}

    async def write_file(self, path: Path, plan: FilePlan) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        pending: asyncio.Future[None] | None = None
        try:
            await in_thread(_write_all, fd, memoryview(plan.header), 0)
            self._advance(len(plan.header))
            base = len(plan.header)
            turn = 0
            # Chunks that are files here first, many windows' worth at a time: a
            # window's 16 chunks on 8 threads left them idle at every window's end.
            rest: list[Piece] = []
            for batch in _windows(pieces(plan, self.window), LOCAL_BATCH):
                rest += await self._write_local(fd, base, batch)
            for group in _windows(rest, self.window):
                start, end = group[0].at, group[-1].at + group[-1].size
                buf = self.buffers[turn] if end - start <= self.window else torch.empty(
                    end - start, dtype=torch.uint8)  # one slab wider than a window
                turn ^= 1
                await self._fill(buf, group, start)
                if pending is not None:
                    await pending
                pending = asyncio.ensure_future(self._write(fd, buf, group, start, base))
            if pending is not None:
                await pending
        except BaseException:
            if pending is not None and not pending.done():
                # The last window's write is still under way: it ends before the
                # descriptor closes (else its next pwrite goes to a closed one, or to
                # whatever file the process opens next under its number).
                pending.cancel()
                await asyncio.wait([pending])
            raise
        finally:
            os.close(fd)

    async def _write_local(self, fd: int, base: int, group: list[Piece]) -> list[Piece]:
        """Writes the group's chunks that are files on this host, each hashed as it
        is copied (``_copy_verified``); returns the pieces left for the window: those
        that are not files here, and those whose file did not hash to the chunk (the
        window writes their bytes again, verified, over what was copied)."""
        local: list[tuple[_Chunk, str, str]] = []
        rest: list[Piece] = []
        for piece in group:
            found = self._local_path(piece.cid) if isinstance(piece, _Chunk) else None
            if found is None:
                rest.append(piece)
            else:
                assert isinstance(piece, _Chunk)
                local.append((piece, *found))
        if not local:
            return rest

        buffers: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(min(self.workers, len(local))):  # (as many as threads run)
            buffers.put(memoryview(bytearray(PIECE)))

        def one(item: tuple[_Chunk, str, str]) -> bool:
            chunk, path, _ = item
            buf = buffers.get()
            try:
                # False: left to the fetcher (other tiers, or the typed failure)
                return _copy_verified(Path(path), chunk, fd, base + chunk.at, buf)
            finally:
                buffers.put(buf)

        done = await spread(local, one, self.workers)
        for (chunk, _, tier), ok in zip(local, done, strict=True):
            if ok:
                self.bytes_local[tier] += chunk.size
                self._advance(chunk.size)
            else:
                rest.append(chunk)
        return sorted(rest, key=lambda p: p.at)

    def _local_path(self, cid: str) -> tuple[str, str] | None:
        """The first chunk file on this host holding ``cid`` (tier order), its tier."""
        for source in self.local_sources:
            holders = source.holders(cid)
            if holders:
                return holders[0], source.tier
        return None

    async def _write(self, fd: int, buf: torch.Tensor, group: list[Piece], start: int,
                     base: int) -> None:
        """Writes the window's pieces, as runs of adjacent ones."""
        view = byte_view(buf)
        runs: list[list[int]] = []
        for piece in group:
            if runs and runs[-1][1] == piece.at:
                runs[-1][1] += piece.size
            else:
                runs.append([piece.at, piece.at + piece.size])
        for a, b in runs:
            await in_thread(_write_all, fd, view[a - start : b - start], base + a)
            self._advance(b - a)

    def _advance(self, n: int) -> None:
        self.done += n
        if self.on_bytes is not None:
            self.on_bytes(self.done, self.total)

    async def _fill(self, buf: torch.Tensor, group: list[Piece], start: int) -> None:
        """Lands every piece of ``group`` in ``buf`` (``start``: the file data offset
        of its first byte), each chunk verified."""
        wanted = WantedChunks()
        view = byte_view(buf)
        for piece in group:
            at = piece.at - start
            if isinstance(piece, _Chunk):
                wanted.add(piece.cid, view[at : at + piece.size], piece.name)
                continue
            t = piece.tensor
            dtype = torch_dtype(t.dtype)
            slab = buf[at : at + piece.size].view(dtype).view((piece.rows, *t.shape[1:]))
            box = ((piece.r0,) + (0,) * (len(t.shape) - 1), (piece.rows, *t.shape[1:]))
            for stored in t.boxes:
                fill_from_entry(wanted, t.source, slab, box, stored.entry, stored.chunk_size,
                                False)
        fetcher = self.fetcher
        try:
            found = await fetcher.locate_all(wanted, atomic=False)
            if fetcher.failed:
                raise failure(fetcher, wanted, self.step)
            await deliver(found, wanted, prefilled=fetcher.prefilled, sent=fetcher.sent)
        finally:
            # A window's views are not kept past it: its maps close, and what it
            # prefilled is not taken for the next window's copies.
            fetcher.prefilled.clear()
            fetcher.stop_prefault()
            for source in fetcher.sources:
                if isinstance(source, DirectoryCacheSource):
                    source.close()


def _windows(items: list[Piece], window: int) -> list[list[Piece]]:
    """Pieces in file order, grouped so that a group spans at most ``window`` bytes
    of the file from its first piece's start (a larger piece alone; pieces written
    already may leave gaps between). A slab starts a group unless it lands aligned
    to its element size there."""
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    for piece in items:
        offset = piece.at - current[0].at if current else 0
        misaligned = isinstance(piece, _Slab) and offset % 16 != 0
        if current and (offset + piece.size > window or misaligned):
            groups.append(current)
            current = []
        current.append(piece)
    if current:
        groups.append(current)
    return groups


def _copy_verified(path: Path, chunk: _Chunk, fd: int, offset: int, buf: memoryview) -> bool:
    """Copies the chunk file at ``path`` to ``fd`` at ``offset`` through ``buf``, a
    piece at a time, hashing as it goes; False when it is not the chunk (its size,
    or its hash at the end: the bytes it wrote are then written again by the tier
    that serves the chunk, or the export fails and its file goes), or cannot be
    read. A failed write to ``fd`` (a full disk) is raised: no tier would help."""
    try:
        src = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            if os.fstat(src).st_size != chunk.size:
                return False
        except OSError:
            return False
        hasher = StreamingHasher()
        done = 0
        while done < chunk.size:
            try:
                n = os.readv(src, [buf[: min(len(buf), chunk.size - done)]])
            except OSError:
                return False  # (a read error: another tier's copy is read instead)
            if n <= 0:
                return False
            hasher.update(buf[:n])
            _write_all(fd, buf[:n], offset + done)
            done += n
    finally:
        os.close(src)
    return hasher.hexdigest() == chunk.cid


def _either(prefixes: Sequence[str]) -> str:
    """``'a.'``, ``'a.' or 'b'``, ``'a.', 'b' or 'c'``."""
    quoted = [repr(p) for p in prefixes]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _nothing_selected(job: str, step: int, only: Sequence[str], exclude: Sequence[str],
                      left_out: Sequence[str]) -> str:
    """Why an export would hold no tensor, and the names it left out (a few)."""
    if only:
        said = (f"step {step} of {job} holds no tensor starting with {_either(only)}"
                + (f" and not with {_either(exclude)}" if exclude else "") + " to export")
    elif exclude and left_out:
        said = (f"step {step} of {job} has no tensor to export: every name starts with "
                f"{_either(exclude)}, which --exclude leaves out")
    else:  # (rank-local entries, values and blobs only: no global tensor)
        said = f"step {step} of {job} holds no tensor to export"
    if left_out:
        more = f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        said += f" (it holds {', '.join(map(repr, left_out[:5]))}{more})"
    return said


def _refused(target: Path, plan: FilePlan, exc: OSError) -> InvalidRequest:
    return InvalidRequest(f"cannot write {target / plan.filename} ({human_bytes(plan.size)}): "
                          f"{exc.strerror or exc}; {write_advice(exc)}")


def _check_room(staging: Path, target: Path, total: int) -> None:
    """Refuses, before a byte is written, an export that ``target``'s filesystem
    (its staging directory's) has not the room for (a full disk found after
    gigabytes helps nobody). Writes can still fail later (another writer, a quota):
    they are told the same way."""
    try:
        st = os.statvfs(staging)
    except OSError:
        return
    if st.f_blocks == 0:  # a filesystem that does not say (some FUSE ones)
        return
    free = st.f_bavail * st.f_frsize
    if free < total:
        raise InvalidRequest(f"{target} has {human_bytes(free)} free and the export needs "
                             f"{human_bytes(total)}; free space there or export elsewhere")


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
