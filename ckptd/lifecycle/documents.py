"""The lifecycle's documents (docs/FORMAT.md, "Lifecycle"): GC state, touched ids,
tags, damage markers and the scrub cursor. Same rules as every other document:
canonical JSON, a ``format`` string and ``version`` 1, unknown fields refused."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from ckptd.format import FORMAT_VERSION, _Document, _load, check_step, job_prefix

GC_STATE_FORMAT: Final = "ckptd.gc_state"
GC_TOUCHED_FORMAT: Final = "ckptd.gc_touched"
TAGS_FORMAT: Final = "ckptd.tags"
DAMAGE_FORMAT: Final = "ckptd.damage"
SCRUB_FORMAT: Final = "ckptd.scrub"

GC_STATE_KEY: Final = "gc/state"
SCRUB_KEY: Final = "gc/scrub"

Phase = Literal["idle", "marking", "sweeping"]


def touched_prefix(generation: int) -> str:
    return f"gc/touched/{generation}/"


def tags_key(job: str) -> str:
    return f"{job_prefix(job)}refs/tags"


def damage_prefix(job: str) -> str:
    return f"{job_prefix(job)}damage/"


def damage_key(job: str, step: int) -> str:
    return f"{damage_prefix(job)}{check_step(step)}.json"


class GcState(_Document):
    """The store's GC lease: which collection runs, in which phase, until when."""

    format: Literal["ckptd.gc_state"] = GC_STATE_FORMAT
    version: Literal[1] = FORMAT_VERSION
    generation: int = Field(ge=0)
    phase: Phase
    holder: str
    started_at: float
    expires_at: float

    @classmethod
    def parse(cls, data: bytes) -> GcState:
        return _load(cls, data, GC_STATE_FORMAT, "GC state")

    def same(self, other: GcState) -> bool:
        """The same collection in the same phase (renewals aside)."""
        return (self.generation, self.phase) == (other.generation, other.phase)


IDLE: Final = GcState(generation=0, phase="idle", holder="", started_at=0.0, expires_at=0.0)


class GcTouched(_Document):
    """Chunk ids a missing-chunks call answered while a collection was marking."""

    format: Literal["ckptd.gc_touched"] = GC_TOUCHED_FORMAT
    version: Literal[1] = FORMAT_VERSION
    generation: int = Field(ge=1)
    ids: list[str]

    @classmethod
    def parse(cls, data: bytes) -> GcTouched:
        return _load(cls, data, GC_TOUCHED_FORMAT, "GC touched ids")


class Tags(_Document):
    """A job's user tags: name -> committed step. Tagged steps are always kept."""

    format: Literal["ckptd.tags"] = TAGS_FORMAT
    version: Literal[1] = FORMAT_VERSION
    tags: dict[str, int]

    @classmethod
    def parse(cls, data: bytes) -> Tags:
        return _load(cls, data, TAGS_FORMAT, "tags")


class Damage(_Document):
    """Scrub found chunks of this committed step corrupt or missing and could not
    repair them: restore of ``latest`` skips the step."""

    format: Literal["ckptd.damage"] = DAMAGE_FORMAT
    version: Literal[1] = FORMAT_VERSION
    job: str
    step: int
    chunks: list[str]
    found_at: float

    @classmethod
    def parse(cls, data: bytes) -> Damage:
        return _load(cls, data, DAMAGE_FORMAT, "damage marker")


class ScrubCursor(_Document):
    """Where the rolling scrub stands: the last chunk id it verified in this pass
    (ids in key order; ``""`` at the start), so the next run resumes after it and
    the chunk verified longest ago is always next."""

    format: Literal["ckptd.scrub"] = SCRUB_FORMAT
    version: Literal[1] = FORMAT_VERSION
    after: str
    pass_started_at: float
    passes: int = Field(ge=0)

    @classmethod
    def parse(cls, data: bytes) -> ScrubCursor:
        return _load(cls, data, SCRUB_FORMAT, "scrub cursor")
