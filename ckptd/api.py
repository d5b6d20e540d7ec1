"""Request and response bodies of the HTTP API (see docs/API.md): the one contract
both sides share. The server's routes answer with these models and the client's
transport parses the answers with the same ones, so a change breaks both at once.

Documents of the format (rank manifests, commit records) are ``ckptd.format``'s own
models; these are the API's envelopes around them.

One module past the house's ~500 lines on purpose: the wire contract is read and
changed in one place (docs/API.md mirrors it), so neither side drifts from it."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ckptd.format import MAX_STEP, MAX_WORLD_SIZE, CommitRecord, RankManifest

# The liveness path: the server answers it, the transport and the container's
# HEALTHCHECK (``ckptd healthcheck``, which must not import torch) ask it.
HEALTHZ = "/healthz"
# The process answers from its event loop, the store not asked: a liveness probe's
# path (a store that is down makes /healthz 503; restarting the server mends nothing).
LIVEZ = "/livez"

__all__ = [
    "HEALTHZ",
    "LIVEZ",
    "ChunkDamage",
    "ChunkStored",
    "ChunkUse",
    "ClusterMember",
    "ClusterView",
    "CommitRequest",
    "CommitResponse",
    "ErrorBody",
    "EventBody",
    "EventList",
    "ForgetResult",
    "GcResult",
    "Health",
    "HealthReport",
    "HeartbeatReply",
    "HeartbeatRequest",
    "JobList",
    "JobSpaceBody",
    "JobSummary",
    "JobView",
    "Latest",
    "ManifestStored",
    "MissingRequest",
    "MissingResponse",
    "Overview",
    "RankList",
    "RankStatus",
    "RestorePlan",
    "RollbackReply",
    "RollbackRequest",
    "ScrubResult",
    "SnapshotReply",
    "SnapshotRequest",
    "SpaceResult",
    "StepDecisionBody",
    "StepList",
    "StepSpaceBody",
    "StepSummary",
    "StepView",
    "StorageView",
    "TagBody",
    "VerifyResult",
    "GcRunBody",
    "GcStatus",
    "ScrubRunBody",
    "ScrubStatus",
]


class _Body(BaseModel):
    # Strict: ``true``, ``"1"`` and ``484.0`` are not integers (item 10 of issue 10).
    # Built at first use: a command line process uses a few of these models.
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)


class _Request(_Body):
    """A request body the server's routes take. Built at import: FastAPI wraps a
    deferred model in its own field and builds it at the first request, where
    pydantic warned in the server's log about the alias FastAPI had set."""

    model_config = ConfigDict(extra="forbid", strict=True, defer_build=False)


class ErrorBody(_Body):
    """Every error answer: a stable code, a message for people, and details."""

    code: str = Field(examples=["chunk_not_found"])
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


class Health(_Body):
    """``/healthz``: ok or not and the version to anyone; details only to a token
    that sees every job (another tenant must not learn where the store is)."""

    status: Literal["ok", "not ok"] = "ok"
    version: str
    store: str | None = Field(default=None, description="Details: only with a token.")
    http_parser: str | None = Field(
        default=None, description="uvicorn's HTTP parser: httptools or h11 (the slower one)."
    )
    event_loop: str | None = Field(default=None, description="The event loop: uvloop or asyncio.")


class MissingRequest(_Request):
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


class CommitRequest(_Request):
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
    latest_moved: bool = Field(
        default=True, exclude_if=lambda v: v is True,
        description="False when the step committed (its record is durable) but the latest "
        "ref could not be written (a full store): a later commit moves it.",
    )


class JobSummary(_Body):
    job: str
    latest: int | None
    damaged: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Why ``latest`` could not be read (a damaged ref); absent when it could.",
    )
    unsupported: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Why ``latest`` could not be read by this ckptd (a newer one wrote it: "
        "upgrade); absent when it could.",
    )


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
    damaged: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="The damaged document that makes this step unusable; absent if none.",
    )
    unsupported: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="A document of the step of a newer format (upgrade ckptd); absent if none.",
    )


class StepList(_Body):
    job: str
    latest: int | None
    steps: list[StepSummary]


class Latest(_Body):
    job: str
    step: int
    problems: list[str] = Field(
        default_factory=list, exclude_if=lambda v: not v,
        description="Damaged documents that made this an older step than the latest ref "
        "(absent when there are none).",
    )


class ChunkUse(_Body):
    step: int
    rank: int
    tensor: str


class ChunkDamage(_Body):
    chunk: str
    problem: Literal["corrupt", "missing", "unreadable"]  # (unreadable: there, does not read)
    breaks: list[ChunkUse] = Field(description="The steps, ranks and tensors it is part of.")


class VerifyResult(_Body):
    job: str
    steps: list[int]
    chunks_checked: int
    bytes_checked: int
    bad_chunks: list[str]
    missing_chunks: list[str]
    bad_manifests: list[str]
    bad_refs: list[str] = Field(default_factory=list, description="Damaged or dangling refs.")
    bad_commits: list[str] = Field(default_factory=list, description="Damaged commit records.")
    damage: list[ChunkDamage] = Field(
        default_factory=list, description="What each bad or missing chunk breaks."
    )
    bytes_total: int = 0
    unreadable: list[str] = Field(
        default_factory=list,
        description="Documents of a format version this server does not read (a newer "
        "ckptd wrote them): not checked, nor what they name; the rest was.")
    ok: bool


# -- liveness, restore plans, coordination -------------------------------------------

StepField = Annotated[int, Field(ge=0, lt=MAX_STEP)]
Reason = Annotated[str, Field(max_length=1024)]
SignalValue = float | int | Annotated[str, Field(max_length=1024)] | None


class HealthReport(_Body):
    """What a rank's health probe says of it."""

    state: Literal["ok", "degraded", "critical"] = "ok"
    reasons: list[Reason] = Field(default_factory=list, max_length=64)
    signals: dict[Annotated[str, Field(max_length=1024)], SignalValue] = Field(
        default_factory=dict,
        max_length=1024,
        description="Probe readings by name, one per instance as name[instance] (e.g. "
        "gpu_temperature_c[0], gpu_ecc_uncorrected_volatile[0], host_memory_percent). "
        "JSON has no NaN: a non-finite reading is the string 'nan', 'inf' or '-inf'.",
    )

    @field_validator("signals")
    @classmethod
    def _finite(cls, signals: dict[str, SignalValue]) -> dict[str, SignalValue]:
        # A NaN loss is a real reading, but JSON has no NaN: kept as text (a body
        # holding a bare NaN never gets here: server.bodies.refuse_non_finite).
        return {
            k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in signals.items()
        }


class HeartbeatRequest(_Request):
    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)
    peer_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://",
        description="Where this rank's peer chunk server answers (http:// or https://).",
    )
    step: StepField | None = Field(default=None, description="The loop's current step.")
    held_step: StepField | None = Field(
        default=None,
        description="The committed step whose chunks this rank's shared-memory pool holds "
        "and serves to peers.",
    )
    health: HealthReport = Field(default_factory=HealthReport)
    rtt_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    launch: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f\x7f]+$",  # (no control characters: it goes into logs)
        description="The launch of the job this rank belongs to (its incarnation, the same "
        "on every rank of one launch): two launches beating at once are told so "
        "(launch_conflict).",
    )


class HeartbeatReply(_Body):
    interval_s: float = Field(description="Send the next heartbeat this many seconds from now.")
    snapshot_at: int | None = Field(
        description="A coordinated snapshot step: every rank saves when its loop reaches it."
    )
    snapshot_reason: str | None
    rollback_to: int | None = Field(description="A committed step the job must go back to.")
    rollback_epoch: int = Field(
        default=0,
        description="The job's timeline (rollbacks so far): two rollbacks to one step differ "
        "in it.",
    )
    peer_token: str | None = Field(
        default=None,
        description="The job's peer token: peer chunk servers of the job require it.",
    )
    peer_url_refused: str | None = Field(
        default=None,
        description="Why the peer_url sent was not registered (None: it was, or none sent).",
    )
    launch_conflict: str | None = Field(
        default=None,
        description="Ranks of another launch of this job beat at the same time as this "
        "one's (two jobs with one name, or a rank of an old launch still running): what "
        "to do, in one line. None: no other launch is live, or none named.",
    )


class RankStatus(_Body):
    rank: int
    state: Literal["alive", "degraded", "critical", "dead", "left"]
    step: int | None
    held_step: int | None
    peer_url: str | None
    last_heartbeat: float = Field(description="Unix time of the last heartbeat.")
    age_s: float = Field(description="Seconds since the last heartbeat.")
    health: HealthReport
    rtt_ms: float | None


class RankList(_Body):
    job: str
    world_size: int | None
    ranks: list[RankStatus]
    latest: int | None
    snapshot_at: int | None
    rollback_to: int | None
    rebuilding: bool = Field(
        default=False,
        description="This replica became the job's home moments ago and is still "
        "gathering its ranks' heartbeats: ranks not listed may be alive.",
    )


class RestorePlan(_Body):
    job: str
    step: int
    rank: int
    world_size: int
    manifest: RankManifest
    manifest_hash: str
    peers: dict[str, list[str]] = Field(
        description="For every chunk id of the manifest, the peer URLs that hold it, best "
        "first (possibly none); the store is always the last source."
    )
    peer_token: str | None = Field(
        default=None, description="The job's peer token, to send to those peers."
    )
    reads: dict[str, str] = Field(
        default_factory=dict,
        description="Over an S3-compatible store: for chunk ids of the manifest, a presigned "
        "GET URL of the chunk's object, to read it straight from the object store (then "
        "verified as any source); empty when the store or the server does not offer them.",
    )
    reads_expire_in: int | None = Field(
        default=None, description="Seconds from the plan's answer that those URLs work."
    )


class StepHolder(_Body):
    rank: int
    url: str


class StepPlan(_Body):
    """A whole committed step in one answer: what a load into any world size reads."""

    job: str
    step: int
    world_size: int
    commit: CommitRecord
    manifests: list[RankManifest] = Field(description="Every rank's manifest, in rank order.")
    holders: list[StepHolder] = Field(
        description="Live ranks (not the asking one) whose pools hold the step, each "
        "serving its own manifest's chunks at its peer URL, best first."
    )
    peer_token: str | None = Field(
        default=None, description="The job's peer token, to send to those peers."
    )
    fallback: list[str] = Field(
        default_factory=list,
        description="Damaged documents that made a load of the latest step an older one.",
    )


class SnapshotRequest(_Request):
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    reason: Annotated[str, Field(min_length=1, max_length=1024)]
    step_time_s: float | None = Field(
        default=None, gt=0, le=86400,
        description="The asking rank's latest step time: the job's pace now, where "
        "heartbeats still carry the pace from before a slowdown.")


class SnapshotReply(_Body):
    snapshot_at: int
    reason: str
    accepted: bool = Field(description="False when a target was pending or set too recently.")


class RollbackRequest(_Request):
    step: StepField
    reason: Reason = "manual"
    from_epoch: int | None = Field(
        default=None, ge=0,
        description="The timeline the asking rank is in. When a rollback has ended it "
        "since, the request is already answered: the current marker comes back unchanged.",
    )


class RollbackReply(_Body):
    rollback_to: int | None
    epoch: int = Field(
        description="The job's timeline: how many rollbacks it has had. Rank manifests "
        "carry it in meta.epoch; those of an ended timeline are refused (409 superseded)."
    )


class EventBody(_Body):
    at: float = Field(description="Unix time.")
    kind: str = Field(
        examples=["snapshot_requested"],
        description="snapshot_requested, snapshot_committed, snapshot_expired, "
        "snapshot_dropped, rollback_set, rollback_cleared, rank_dead, rank_back, rank_left, "
        "restore_fallback, launch_conflict",
    )
    rank: int | None
    step: int | None
    reason: str


class EventList(_Body):
    job: str
    events: list[EventBody]


class StepView(_Body):
    step: int
    committed: bool
    world_size: int | None
    ranks_present: int
    logical_bytes: int | None
    committed_at: float | None
    is_latest: bool
    reason: str | None = Field(description="Why it was taken (the commit's meta.reason).")
    requested_by: int | None
    damaged: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="The damaged document that makes this step unusable; absent if none.",
    )
    unsupported: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="A document of the step of a newer format (upgrade ckptd); absent if none.",
    )


class JobView(_Body):
    job: str
    latest: int | None
    world_size: int | None
    snapshot_at: int | None
    snapshot_reason: str | None
    rollback_to: int | None
    ranks: list[RankStatus]
    steps: list[StepView] = Field(description="The newest steps, oldest first.")
    events: list[EventBody] = Field(description="The newest events, oldest first.")
    damaged_steps: list[int] = Field(
        default_factory=list, description="Committed steps scrub marked damaged (latest skips)."
    )
    rebuilding: bool = Field(default=False, description="As in RankList.")
    damaged: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Why the job's latest ref (or more) cannot be read: it is damaged; "
        "absent when it can.",
    )
    unsupported: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Why the job's latest ref (or more) cannot be read by this ckptd (a newer "
        "one wrote it: upgrade); absent when it can.",
    )


class StorageView(_Body):
    since: float = Field(description="Unix time the server started; the counters start there.")
    chunks_stored: int
    bytes_stored: int
    chunks_offered: int
    chunks_missing: int
    dedup_ratio: float | None = Field(
        description="Chunk ids offered / ids the store lacked (None before any were lacking)."
    )
    uploads: int
    upload_bytes: int
    restores: int
    restore_bytes: int
    commits: int
    rejected_uploads: int


class Overview(_Body):
    version: str
    store: str
    interval_s: float
    dead_after_s: float
    storage: StorageView
    jobs: list[JobView]


# -- the store's lifecycle: ckptd/api_lifecycle.py, re-exported here ---------------

from ckptd.api_lifecycle import (  # noqa: E402
    ForgetResult,
    GcResult,
    GcRunBody,
    GcStatus,
    JobSpaceBody,
    ScrubResult,
    SpaceResult,
    StepDecisionBody,
    StepSpaceBody,
    TagBody,
)


class ScrubRunBody(_Body):
    """A scrub running in the background on the server that answers, and how far it is."""

    id: str
    started_at: float = Field(description="Unix time it started.")
    budget_bytes: int | None = Field(description="Bytes it reads at most (null: a whole pass).")
    chunks_total: int | None = Field(description="Chunks in the store when it listed them "
                                     "(a whole pass checks each); null until listed.")
    chunks_checked: int
    bytes_checked: int
    corrupt: int = Field(description="Corrupt chunks found so far.")
    ended_at: float | None = None
    report: ScrubResult | None = Field(None, description="Its report, once it ended well.")
    error: dict[str, Any] | None = Field(None, description="Its typed error, once it failed.")


class ScrubStatus(_Body):
    running: ScrubRunBody | None = Field(description="A scrub started with POST "
                                         "/v1/scrub/runs that has not ended.")
    last_run: ScrubRunBody | None = Field(description="The last one that ended.")
    last: ScrubResult | None = Field(description="This server's last scrub of any kind "
                                     "(background, --scrub-interval, POST /v1/scrub).")


# -- replicas ------------------------------------------------------------------------


class ClusterMember(_Body):
    id: str = Field(description="The replica's name (a StatefulSet pod name, host_port).")
    url: str = Field(description="Where clients reach it: http(s)://host:port.")
    expires_at: float | None = Field(
        default=None, description="Unix time its store lease runs out (None: static list)."
    )
    store_id: str | None = Field(
        default=None,
        description="The id of the store it serves as the answering replica last heard "
        "(itself: its own; a --peers peer: from its GET /v1/cluster). None: not known.",
    )


class ClusterView(_Body):
    mode: Literal["single", "static", "lease"] = Field(
        description="single: this server alone; static: --peers; lease: leases in the store."
    )
    self_url: str = Field(description="This replica's own URL.")
    store_id: str | None = Field(
        default=None,
        description="The id of the store it serves (cluster/store-id): one for every "
        "replica of a cluster. None: not read (a store that did not answer at start).",
    )
    members: list[ClusterMember] = Field(description="The live replicas, this one included.")

