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
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zarr
import zarr.codecs
from zarr.core.buffer import default_buffer_prototype
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
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InvalidRequest(f"{target} exists and is not an empty directory; "
                             "export into a new one")
    compressor = _compressor(codec)
    created = not target.exists()
    try:  # before reading anything: a directory that cannot be made is a usage mistake
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidRequest(f"cannot create {target}: {exc.strerror}; export into a "
                             "directory you can write") from None
    t0 = time.perf_counter()
    view = CheckpointStore(url, job, step, token, transport=transport)
    try:
        h = sync(view.hierarchy())
        out = LocalStore(str(target))
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
    except BaseException as exc:
        # The directory was new or empty: what is in it now is this export's, and
        # half a hierarchy is not one a reader should open. (An unknown job or
        # step leaves no empty directory behind either.)
        _remove_contents(target, created)
        if isinstance(exc, OSError) and not isinstance(exc, CkptdError):
            # A write zarr's store could not make: a full disk, a quota, ``ulimit -f``.
            raise InvalidRequest(f"cannot write into {target}: {exc.strerror or exc}; "
                                 "free space there or export elsewhere") from None
        raise
    finally:
        view.close()
    log.info("exported step %d of %s: %d arrays, %d bytes in %.2f s", result.step, job,
             result.arrays, result.nbytes, result.seconds)
    return result


def _remove_contents(target: Path, created: bool) -> None:
    if not target.is_dir():
        return
    if created:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


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
    """The view's keys, one object each, into a ckptd store (``s3://bucket/prefix``)."""
    from ckptd.store import open_store

    encode = _object_codec(codec)
    t0 = time.perf_counter()
    view = CheckpointStore(url, job, step, token, transport=transport)
    target = open_store(target_url)

    async def write() -> tuple[Hierarchy, int]:
        try:
            return await _write_keys(view, target, target_url, encode)
        finally:
            await target.close()

    try:
        h, chunks = sync(write())
        assert view.step is not None
        nbytes = sum(_nbytes(n) for n in h.arrays.values())
        return ExportResult(view.step, len(h.arrays), chunks, nbytes,
                            time.perf_counter() - t0, target_url)
    finally:
        view.close()


async def _write_keys(view: CheckpointStore, target: ObjectStore, target_url: str,
                      encode: tuple[dict[str, Any], Any] | None) -> tuple[Hierarchy, int]:
    async for _ in target.list_prefix(""):
        raise InvalidRequest(f"{target_url} is not empty; export into a new prefix")
    h = await view.hierarchy()
    for path in h.groups:
        meta = h.metadata(path)
        await target.put_if_absent(join(path, "zarr.json"), canonical_json(meta))
    chunks = 0
    for path, node in h.arrays.items():
        meta = array_metadata(node)
        if encode is not None:
            meta["codecs"].append(encode[0])
        await target.put_if_absent(join(path, "zarr.json"), canonical_json(meta))
        indices = list(chunk_indices(node.grid))

        async def one(index: tuple[int, ...], node: ArrayNode = node,
                      path: str = path) -> None:
            data = await view.chunk(node, index)
            if data is None:
                return
            if encode is not None:
                data = bytes(await asyncio.to_thread(encode[1].encode, data))
            await target.put_if_absent(chunk_key(path, index), data)

        for start in range(0, len(indices), BATCH):
            await asyncio.gather(*(one(i) for i in indices[start : start + BATCH]))
        chunks += len(indices)
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
