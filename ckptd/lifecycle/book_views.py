"""What the census's book answers, as plain values: the book itself
(``ckptd.lifecycle.space_book``, numpy's) runs in the census worker's process, and
a server that only talks to that process imports these, not numpy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# Steps whose rank manifests add up to less than this are counted from them again
# (cheaper than another document to read); larger ones get a space summary.
SUMMARY_MIN_BYTES: Final = 4 << 20


class BookError(Exception):
    """A document the book could not count (damaged, or a newer ckptd's); its text
    names the document. Plain, so that it crosses the process boundary."""


@dataclass(frozen=True, slots=True)
class Begun:
    """What a commit record says that its counting needs."""

    world_size: int
    manifest_bytes: int  # the rank manifests' sizes, summed
    digest: str


@dataclass(frozen=True, slots=True)
class JobView:
    job: str
    stored_bytes: int
    logical_bytes: int
    steps: tuple[tuple[int, int, int], ...]  # (step, logical bytes, unique bytes)


@dataclass(frozen=True, slots=True)
class BookView:
    jobs: tuple[JobView, ...]
    referenced_chunks: int  # distinct chunks that counted steps name
    referenced_bytes: int
    references: int  # (step, chunk) pairs held: the book's size, 12 bytes each
    # Not in the last listing of chunks/ (``listed``): referenced now, or named by
    # counts dropped since (forgotten steps: in the store until a collection)
    new_chunks: int = 0
    new_bytes: int = 0
