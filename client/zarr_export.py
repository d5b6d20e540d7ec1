"""``ckptd export --zarr``: a committed step written out as a plain zarr v3 hierarchy.

The export is the zarr view made concrete: the same groups, arrays, grids and
attributes, in a directory (or under an ``s3://bucket/prefix``, written through
ckptd's own S3 store) that any zarr v3 reader opens without ckptd. Every chunk is
verified on its way out (it is read through the view). Without a codec the zarr
chunks are copied as they are; with one (``zstd``, ``gzip``, ``blosc``) zarr
encodes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import zarr
import zarr.codecs
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore

from ckptd.errors import CkptdError, InvalidRequest
from ckptd.format import canonical_json
from ckptd.store.base import Store as ObjectStore
from ckptd.zarr.grid import chunk_indices
from ckptd.zarr.hierarchy import (
    ZARR_DTYPES,
    ArrayNode,
    Hierarchy,
    array_metadata,
    chunk_key,
    join,
)

from .export_staging import check_target, discard, publish, stage, write_advice
from .loop import ClientClosing
from .transport import Transport
from .zarr_view import CheckpointStore

log = logging.getLogger(__name__)

CODECS = ("zstd", "gzip", "blosc")
BATCH = 64  # zarr chunks copied at once
SLAB = 64 * 1024 * 1024  # bytes encoded at once


@dataclass(frozen=True, slots=True)
class ExportResult:
    step: int
    arrays: int
    chunks: int
    nbytes: int  # the tensors' bytes (logical)
    seconds: float
    directory: str


def _compressor(codec: str | None) -> Any:
    if codec is None:
        return None
    if codec == "zstd":
        return zarr.codecs.ZstdCodec(level=1)
    if codec == "gzip":
        return zarr.codecs.GzipCodec(level=5)
    if codec == "blosc":
        return zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")
    raise InvalidRequest(f"unknown codec {codec!r}; use one of {', '.join(CODECS)}")


def export_step(
    url: str,
    job: str,
    directory: str | Path,
    step: int | None = None,
    *,
    token: str | None = None,
    codec: str | None = None,
    transport: Transport | None = None,
) -> ExportResult:
    """Writes step ``step`` (default: latest) of ``job`` to ``directory`` as zarr v3."""
    if str(directory).startswith("s3://"):
        return _export_to_store(url, job, str(directory), step, token, codec, transport)
    target = Path(directory)
    check_target(target)
    compressor = _compressor(codec)
    t0 = time.perf_counter()
    view = CheckpointStore(url, job, step, token, transport=transport)
    try:
        try:  # before reading anything: a directory that cannot be made is a usage mistake
            staging = stage(target)
        except OSError as exc:
            raise InvalidRequest(f"cannot create {target}: {exc.strerror}; export into a "
                                 "directory you can write") from None
        out = _Output(str(staging.path))
        try:
            h = sync(view.hierarchy())
            root = zarr.create_group(store=out, zarr_format=3,
                                     attributes=h.groups[""].attributes)
            for path, group in h.groups.items():
                if path:
                    root.create_group(path, attributes=group.attributes)
            chunks = 0
            for path, node in h.arrays.items():
                chunks += _export_array(view, out, root, path, node, compressor)
            nbytes = sum(_nbytes(n) for n in h.arrays.values())
            assert view.step is not None
            result = ExportResult(view.step, len(h.arrays), chunks, nbytes,
                                  time.perf_counter() - t0, str(target))
            publish(staging, "zarr.json")  # (the root's, what a reader opens first: last)
        except BaseException as exc:
            # Half a hierarchy is not one a reader should open: none is left, not even
            # an empty directory for an unknown job or step. Zarr's own thread may
            # still be writing (a Ctrl-C stops this one only): no write starts from
            # now, and the ones under way end before the staging directory goes.
            out.gate.shut()
            discard(staging)
            if isinstance(exc, OSError) and not isinstance(exc, CkptdError):
                # A write zarr's store could not make: a full disk, a quota, ``ulimit -f``.
                raise InvalidRequest(f"cannot write into {target}: {exc.strerror or exc}; "
                                     f"{write_advice(exc)}") from None
            raise
    finally:
        view.close()
    log.info("exported step %d of %s: %d arrays, %d bytes in %.2f s", result.step, job,
             result.arrays, result.nbytes, result.seconds)
    return result


class _Gate:
    """Counts the writes under way; once shut, no write starts."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._shut = False

    @contextlib.contextmanager
    def passing(self) -> Iterator[None]:
        with self._cond:
            if self._shut:
                raise ClientClosing("interrupted: the export stopped")
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def shut(self, timeout: float = 60.0) -> None:
        """Lets no write start and waits (bounded) for the ones under way."""
        with self._cond:
            self._shut = True
            self._cond.wait_for(lambda: self._busy == 0, timeout)


class _Output(LocalStore):
    """The staging directory as zarr's store, its writes through a gate: zarr runs
    them on a thread of its own, which goes on after an error or a Ctrl-C in the
    caller's (its next chunk file would make the removed directory again)."""

    def __init__(self, root: str, read_only: bool = False, gate: _Gate | None = None) -> None:
        super().__init__(root, read_only=read_only)
        self.gate = gate or _Gate()

    def with_read_only(self, read_only: bool = False) -> Self:
        return type(self)(str(self.root), read_only, self.gate)

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        with self.gate.passing():
            await super()._set(key, value, exclusive)


# Codecs an export to an object store encodes itself (numcodecs, as zarr's do):
# their v3 metadata and their encoder.
def _object_codec(codec: str | None) -> tuple[dict[str, Any], Any] | None:
    if codec is None:
        return None
    import numcodecs

    if codec == "zstd":
        return ({"name": "zstd", "configuration": {"level": 1, "checksum": False}},
                numcodecs.Zstd(level=1))
    if codec == "gzip":
        return {"name": "gzip", "configuration": {"level": 5}}, numcodecs.GZip(level=5)
    raise InvalidRequest(f"codec {codec!r} is not available for s3:// exports; use zstd or gzip")


def _export_to_store(url: str, job: str, target_url: str, step: int | None,
                     token: str | None, codec: str | None,
                     transport: Transport | None) -> ExportResult:
    """The view's keys, one object each, into a ckptd store (``s3://bucket/prefix``).
    An object store has no rename: a failed or interrupted export deletes the
    objects it wrote, and the root's ``zarr.json`` (what opens the hierarchy) is
    written last, so that one killed outright leaves none."""
    from ckptd.store import open_store

    encode = _object_codec(codec)
    t0 = time.perf_counter()
    view = CheckpointStore(url, job, step, token, transport=transport)
    target = open_store(target_url)
    # Zarr's loop thread runs the export; a Ctrl-C lands in this one, which then
    # stops it and waits until what it wrote is deleted.
    stop, began, ended = threading.Event(), threading.Event(), threading.Event()

    async def write() -> tuple[Hierarchy, int]:
        began.set()
        written: list[str] = []
        try:
            return await _write_keys(view, target, target_url, encode, written, stop)
        except BaseException:
            for start in range(0, len(written), BATCH):  # (absent keys are no error)
                await asyncio.gather(*(target.delete(key)
                                       for key in written[start : start + BATCH]),
                                     return_exceptions=True)
            raise
        finally:
            await target.close()
            ended.set()

    try:
        h, chunks = sync(write())
        assert view.step is not None
        nbytes = sum(_nbytes(n) for n in h.arrays.values())
        return ExportResult(view.step, len(h.arrays), chunks, nbytes,
                            time.perf_counter() - t0, target_url)
    except KeyboardInterrupt:
        stop.set()
        if began.is_set():
            ended.wait(60.0)
        raise
    finally:
        view.close()


async def _write_keys(view: CheckpointStore, target: ObjectStore, target_url: str,
                      encode: tuple[dict[str, Any], Any] | None, written: list[str],
                      stop: threading.Event) -> tuple[Hierarchy, int]:
    async for _ in target.list_prefix(""):
        raise InvalidRequest(f"{target_url} is not empty; export into a new prefix")

    async def put(key: str, data: bytes) -> None:
        if stop.is_set():
            raise ClientClosing("interrupted: the export stopped")
        written.append(key)  # (the prefix was empty: what is under it is this export's)
        await target.put_if_absent(key, data)

    h = await view.hierarchy()
    for path in h.groups:
        if path:
            await put(join(path, "zarr.json"), canonical_json(h.metadata(path)))
    chunks = 0
    for path, node in h.arrays.items():
        meta = array_metadata(node)
        if encode is not None:
            meta["codecs"].append(encode[0])
        await put(join(path, "zarr.json"), canonical_json(meta))
        indices = list(chunk_indices(node.grid))

        async def one(index: tuple[int, ...], node: ArrayNode = node,
                      path: str = path) -> None:
            if stop.is_set():
                raise ClientClosing("interrupted: the export stopped")
            data = await view.chunk(node, index)
            if data is None:
                return
            if encode is not None:
                data = bytes(await asyncio.to_thread(encode[1].encode, data))
            await put(chunk_key(path, index), data)

        for start in range(0, len(indices), BATCH):
            # Every put of the batch ends before an error is raised: none lands
            # after the cleanup's deletes.
            done = await asyncio.gather(*(one(i) for i in indices[start : start + BATCH]),
                                        return_exceptions=True)
            for outcome in done:
                if isinstance(outcome, BaseException):
                    raise outcome
        chunks += len(indices)
    await put("zarr.json", canonical_json(h.metadata("")))  # the root's, last
    return h, chunks


def _nbytes(node: ArrayNode) -> int:
    n = node.grid.itemsize
    for s in node.grid.shape:
        n *= s
    return n


def _export_array(view: CheckpointStore, out: LocalStore, root: zarr.Group, path: str,
                  node: ArrayNode, compressor: Any) -> int:
    meta = array_metadata(node)
    data_type, fill = ZARR_DTYPES[node.dtype]
    if isinstance(fill, list):  # a complex fill value in its JSON form
        fill = complex(*fill)
    dst = root.create_array(
        path, shape=node.grid.shape, chunks=node.grid.chunk_shape, dtype=data_type,
        fill_value=fill, attributes=meta["attributes"], compressors=compressor,
    )
    indices = list(chunk_indices(node.grid))
    if compressor is None:
        # The view's chunks are already what the bytes codec stores: copy them.
        async def copy(index: tuple[int, ...]) -> None:
            data = await view.chunk(node, index)
            if data is not None:
                buf = default_buffer_prototype().buffer.from_bytes(data)
                await out.set(chunk_key(path, index), buf)

        async def copy_all() -> None:
            for start in range(0, len(indices), BATCH):
                await asyncio.gather(*(copy(i) for i in indices[start : start + BATCH]))

        sync(copy_all())
    else:
        src = zarr.open_array(store=view, path=path, mode="r")
        shape = node.grid.shape
        if not shape:
            dst[...] = src[...]
            return len(indices)
        # Slabs of whole chunk rows, ~SLAB bytes: zarr reads and encodes a slab's
        # chunks concurrently.
        rows = node.grid.chunk_shape[0]
        row_bytes = max(1, _nbytes(node) // max(1, shape[0]))
        slab = max(rows, SLAB // row_bytes // rows * rows)
        for r0 in range(0, shape[0], slab):
            dst[r0 : r0 + slab] = src[r0 : r0 + slab]
    return len(indices)
