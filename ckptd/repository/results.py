"""What the repository's calls answer: missing chunks, commit status, step
listings, the step a restore gets, verify reports and rollbacks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from ckptd.format import CommitRecord, Ref

# Which of these stored chunk ids a tenant may know of (see missing_chunks).
KnownChunks = Callable[[list[str]], Awaitable[set[str]]]


class DamagedView(Protocol):
    """The chunks scrub found corrupt, as saves meet them (``Repository.damaged``;
    ``ckptd.lifecycle.damaged_chunks.DamagedChunks`` is the one)."""

    async def sound(self, ids: Sequence[str], present: list[bool]) -> list[bool]: ...

    async def uploaded(self, cid: str, good: bytes | memoryview) -> None: ...

    async def check_commit(self, job: str, step: int, ids: Sequence[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class MissingResult:
    """Answer to a missing-chunks call: what the caller should send, and what
    another caller has claimed and is sending now (wait for those)."""

    missing: list[str]
    in_flight: list[str]


@dataclass(frozen=True, slots=True)
class CommitStatus:
    state: Literal["committed", "pending"]
    job: str
    step: int
    world_size: int | None
    missing_ranks: list[int]
    record: CommitRecord | None = None
    latest_moved: bool = True  # False: committed, but the latest ref could not be written
    rollback_cleared: bool = False  # this commit ended the job's rollback (it is past it)


@dataclass(frozen=True, slots=True)
class StepInfo:
    step: int
    committed: bool
    world_size: int | None
    ranks_present: int
    logical_bytes: int | None
    committed_at: float | None
    is_latest: bool
    damaged: str | None = None  # what is wrong with the step's documents, if anything
    unsupported: str | None = None  # a document of a newer format: upgrade ckptd


@dataclass(frozen=True, slots=True)
class RestorableStep:
    """The step a restore of "latest" should use, and why it is not ``latest``
    itself when it is not (each problem names a damaged document)."""

    step: int | None
    problems: list[str]


@dataclass(slots=True)
class VerifyReport:
    job: str
    steps: list[int]
    chunks_checked: int = 0
    bytes_checked: int = 0
    bad_chunks: list[str] = field(default_factory=list)
    missing_chunks: list[str] = field(default_factory=list)
    bad_manifests: list[str] = field(default_factory=list)
    bad_refs: list[str] = field(default_factory=list)
    bad_commits: list[str] = field(default_factory=list)
    # Per bad or missing chunk: {"chunk", "problem", "breaks": [{"step", "rank", "tensor"}]}
    damage: list[dict[str, Any]] = field(default_factory=list)
    bytes_total: int = 0
    # Documents of a format version this ckptd does not read (a newer ckptd wrote
    # them): not damage, but not checked either (and what they name neither).
    unreadable: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.bad_chunks or self.missing_chunks or self.bad_manifests
                    or self.bad_refs or self.bad_commits or self.unreadable)


class RollbackSet(NamedTuple):
    """What ``set_rollback`` did: the marker, the job's timeline, and whether this
    call started it (False: the rollback asked for was already set)."""

    marker: Ref
    epoch: int
    started: bool
