"""The pool's ``index.json``: the layout a stage records for a reader (written
before the copies, then again with the chunk ids once a piece is hashed), written
to a temporary name and renamed into place."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ..dtypes import dtype_name
from .format import INDEX_NAME, PoolIndex, PoolState, SegmentRecord, SpanRecord
from .layout import TensorInfo, _Placed
from .segments import _Segment

log = logging.getLogger(__name__)


def span_records(plan_infos: Sequence[TensorInfo], placed: Sequence[_Placed], chunk_size: int,
                 segments: Sequence[_Segment]) -> tuple[SpanRecord, ...]:
    """The index's record of each placed span."""
    return tuple(
        SpanRecord(
            name=plan_infos[p.index].name,
            dtype=dtype_name(plan_infos[p.index].dtype),
            shape=tuple(plan_infos[p.index].shape),
            nbytes=plan_infos[p.index].nbytes,
            start=p.start,
            end=p.end,
            first_chunk=p.start // chunk_size,
            segment=segments[p.segment].file,
            offset=p.offset,
        )
        for p in placed
    )


def index_doc(job: str, rank: int, segments: Sequence[_Segment], infos: Sequence[TensorInfo],
              placed: Sequence[_Placed], chunk_size: int, *, state: PoolState,
              step: int | None, generation: int, piece: tuple[int, int]) -> PoolIndex:
    """The index of a pool whose ``segments`` hold the ``placed`` spans."""
    return PoolIndex(
        job=job,
        rank=rank,
        pid=os.getpid(),
        state=state,
        step=step,
        generation=generation,
        chunk_size=chunk_size,
        piece=piece,
        segments=tuple(SegmentRecord(s.file, s.nbytes, s.path is not None) for s in segments),
        entries=span_records(infos, placed, chunk_size, segments),
    )


def write_index(directory: Path, doc: PoolIndex) -> None:
    """Replaces the pool's index with ``doc`` (a hint: failing only logs)."""
    path = directory / INDEX_NAME
    tmp = directory / f"{INDEX_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_bytes(doc.encode())
        os.replace(tmp, path)
    except OSError as exc:  # the index is a hint: losing it only slows a restart
        log.warning("staging: cannot write %s: %s", path, exc)
