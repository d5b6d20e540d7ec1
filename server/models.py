"""Request and response bodies of the HTTP API (see docs/API.md).

Documents of the format (rank manifests, commit records) are ``ckptd.format``'s own
models; these are the API's envelopes around them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ckptd.format import CommitRecord


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Body):
    """Every error answer: a stable code, a message for people, and details."""

    code: str = Field(examples=["chunk_not_found"])
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


class Health(_Body):
    status: Literal["ok"] = "ok"
    version: str
    store: str


class MissingRequest(_Body):
    ids: list[str] = Field(description="Chunk ids (64 lowercase hex digits).")
    claimer: str | None = Field(
        default=None,
        max_length=256,
        description="Who asks; the ids returned missing are leased to it for a short time.",
    )


class MissingResponse(_Body):
    missing: list[str] = Field(description="Ids the store lacks; send these.")
    in_flight: list[str] = Field(
        description="Ids another claimer is sending now; wait for them instead."
    )


class ChunkStored(_Body):
    id: str
    size: int
    created: bool = Field(description="False when the store already held the chunk.")


class ManifestStored(_Body):
    hash: str = Field(description="The blake3 of the manifest's canonical bytes.")


class CommitRequest(_Body):
    meta: dict[str, Any] = Field(
        default_factory=dict, description="Caller's notes, kept in the commit record."
    )


class CommitResponse(_Body):
    state: Literal["committed", "pending"]
    job: str
    step: int
    world_size: int | None
    missing_ranks: list[int] = Field(description="Ranks whose manifests are not in yet.")
    record: CommitRecord | None


class JobSummary(_Body):
    job: str
    latest: int | None


class JobList(_Body):
    jobs: list[JobSummary]


class StepSummary(_Body):
    step: int
    committed: bool
    world_size: int | None
    ranks_present: int
    logical_bytes: int | None
    committed_at: float | None
    is_latest: bool


class StepList(_Body):
    job: str
    latest: int | None
    steps: list[StepSummary]


class Latest(_Body):
    job: str
    step: int


class VerifyResult(_Body):
    job: str
    steps: list[int]
    chunks_checked: int
    bytes_checked: int
    bad_chunks: list[str]
    missing_chunks: list[str]
    bad_manifests: list[str]
    ok: bool
