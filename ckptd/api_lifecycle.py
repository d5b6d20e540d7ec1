"""The HTTP API's answers about the store's lifecycle: garbage collection,
retention, scrub, tags and space (``ckptd.api`` re-exports them). Plain models:
their answers predate strict bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class GcResult(BaseModel):
    dry_run: bool
    generation: int
    chunks_total: int
    chunks_kept: int
    chunks_deleted: int
    bytes_total: int
    bytes_freed: int
    manifests_read: int
    seconds: float
    deleted: list[str] = Field(description="Chunk ids deleted (or, dry, that would be).")


class GcRunBody(BaseModel):
    """A collection running in the background on the server that answers."""

    id: str
    started_at: float = Field(description="Unix time it started.")
    grace: float = Field(description="Seconds it waits before it sweeps (saves in flight "
                         "finish meanwhile).")
    ended_at: float | None = None
    report: GcResult | None = Field(None, description="Its report, once it ended well.")
    error: dict[str, Any] | None = Field(None, description="Its typed error, once it failed.")


class GcStatus(BaseModel):
    state: dict[str, Any] = Field(description="The store's GC state (generation, lease).")
    last: dict[str, Any] | None = Field(
        description="This server's last collection (deleted: how many chunks).")
    running: GcRunBody | None = Field(None, description="A collection started with POST "
                                      "/v1/gc/runs that has not ended.")
    last_run: GcRunBody | None = Field(None, description="The last one that ended.")


class StepDecisionBody(BaseModel):
    step: int
    committed: bool
    decision: str = Field(description="keep, forget, abandon or pending")
    reasons: list[str]
    kept_by: list[str] = Field(
        default_factory=list, description="What keeps a kept step, as `reasons` say it: the "
        "rules (keep_last, keep_every, keep_within, keep_tagged), latest, rollback, damaged "
        "or no_rule.")


class ForgetResult(BaseModel):
    job: str
    dry_run: bool
    forgotten: list[int]
    steps: list[StepDecisionBody]
    rules: dict[str, int | float | bool] | None = Field(
        None, description="The retention rules applied, as a retention file spells them "
        "(durations in seconds; keep_tagged only when false): the server's retention file's "
        "for the job, with keep_last as the request gave it. None for `step`.")


class ScrubResult(BaseModel):
    chunks_checked: int
    bytes_checked: int
    corrupt: list[str]
    repaired: list[str]
    damaged: dict[str, list[int]]
    passes_completed: int
    seconds: float
    damaged_documents: list[str] = Field(
        default_factory=list, description="Other damaged documents scrub met, each named "
        "and what became of it (its cursor or a damage marker: replaced).")
    whole_again: dict[str, list[int]] = Field(
        default_factory=dict, description="Steps of each job a damage marker named whose "
        "damaged chunks read good now (repaired, or put back): restorable again.")
    unreadable: list[str] = Field(
        default_factory=list, description="Those of corrupt whose object does not read at "
        "all (a link that loops, a FIFO, a read error), not one of wrong bytes.")


class TagBody(BaseModel):
    step: int


class StepSpaceBody(BaseModel):
    step: int
    logical_bytes: int
    unique_bytes: int


class JobSpaceBody(BaseModel):
    job: str
    stored_bytes: int
    logical_bytes: int
    dedup_ratio: float | None
    steps: list[StepSpaceBody]


class SpaceResult(BaseModel):
    chunk_bytes: int
    chunks: int
    free_bytes: int | None
    total_bytes: int | None
    taken_at: float
    jobs: list[JobSpaceBody]
    damaged: list[str] = Field(
        default_factory=list,
        description="Damaged documents whose steps are not counted, each named.")
    complete: bool = Field(
        default=True, description="Every committed step is counted and chunks/ was listed: "
        "false while the census is still counting (after a start, or many new steps), "
        "or lists chunks/ again (listing_again).")
    uncounted_steps: int = Field(
        default=0, description="Committed steps found and not counted yet.")
    chunks_listed_at: float | None = Field(
        default=None, description="When chunks and chunk_bytes were counted (a listing of "
        "chunks/, or a garbage collection's); null: not yet.")
    referenced_bytes: int = Field(
        default=0, description="Bytes of the distinct chunks the counted steps name.")
    referenced_chunks: int | None = Field(
        default=None, description="Distinct chunks the counted steps name (null: an older "
        "server's answer).")
    unreferenced_chunks: int | None = Field(
        default=None, description="Chunks in the store that no committed step names (those "
        "of forgotten steps among them): what a garbage collection deletes, but for the "
        "chunks of saves still under way.")
    unreferenced_bytes: int | None = Field(default=None, description="Their bytes.")
    listing_again: bool = Field(
        default=False, description="chunks/ is being listed again because steps were "
        "forgotten before the census counted them: their chunks are in the store and not "
        "in chunks yet (complete is false meanwhile).")
