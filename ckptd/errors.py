"""The typed error tree of ckptd.

Every error has a stable ``code`` (append-only: never renamed or reused) that the
HTTP API returns in its JSON error body, and the client turns back into the same
type. ``HTTP_STATUS`` is the one place that maps codes to HTTP statuses.
"""

from __future__ import annotations

from typing import Any, ClassVar


class CkptdError(Exception):
    """Root of every error ckptd raises on purpose."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "detail": self.detail}


# -- bad input (4xx) ------------------------------------------------------------------


class InvalidRequest(CkptdError, ValueError):
    code = "invalid_request"


class InvalidName(InvalidRequest):
    """A job name, chunk id, step or rank that does not match its pattern."""

    code = "invalid_name"


class InvalidDocument(InvalidRequest):
    """A manifest or commit record that does not parse or breaks the format."""

    code = "invalid_document"


class UnsupportedFormat(InvalidDocument):
    """A document whose format version this reader does not know."""

    code = "unsupported_format"


class UnsupportedValue(InvalidRequest, TypeError):
    """A state-dict leaf that ckptd cannot store without pickling."""

    code = "unsupported_value"


class TooLarge(InvalidRequest):
    code = "too_large"


class UnsupportedMediaType(InvalidRequest):
    """A request body whose Content-Type is not the one its route reads (JSON)."""

    code = "unsupported_media_type"


class MethodNotAllowed(InvalidRequest):
    """A method the route does not take (its ``Allow`` header says which do)."""

    code = "method_not_allowed"


class LengthRequired(InvalidRequest):
    """An upload with neither a Content-Length nor chunked transfer encoding: HTTP
    reads it as having no body, which is not what its sender meant."""

    code = "length_required"


class Unauthorized(CkptdError, PermissionError):
    code = "unauthorized"


class Forbidden(CkptdError, PermissionError):
    code = "forbidden"


# -- missing things (404) -------------------------------------------------------------


class NotFound(CkptdError, KeyError):
    code = "not_found"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class ChunkNotFound(NotFound):
    code = "chunk_not_found"


class ManifestNotFound(NotFound):
    code = "manifest_not_found"


class CheckpointNotFound(NotFound):
    """No committed checkpoint for the job (and step) asked for."""

    code = "checkpoint_not_found"


class JobNotFound(NotFound):
    code = "job_not_found"


# Up to this many jobs are named when a job is not found; more are counted.
JOBS_NAMED = 10


def job_not_found(job: str, jobs: list[str], where: str) -> JobNotFound:
    """The error for a job the store at ``where`` does not hold, naming those it does
    (the CLI's words, and the zarr view's)."""
    if not jobs:
        known = "it holds no jobs yet"
    elif len(jobs) <= JOBS_NAMED:
        known = "jobs there: " + ", ".join(sorted(jobs))
    else:
        known = f"it holds {len(jobs)} jobs (`ckptd ls` lists them)"
    return JobNotFound(f"no job {job!r} at {where}; {known}", job=job)


# -- integrity: bytes that are not what their name says ---------------------------------


class IntegrityError(CkptdError):
    code = "integrity"


class ChunkHashMismatch(IntegrityError, ValueError):
    """A chunk's bytes do not hash to its id (on upload, on read, on restore)."""

    code = "chunk_hash_mismatch"


class ChunkSizeMismatch(IntegrityError, ValueError):
    code = "chunk_size_mismatch"


class ManifestHashMismatch(IntegrityError, ValueError):
    code = "manifest_hash_mismatch"


# -- cross-rank validation of a step (409: the step cannot commit as it is) -------------


class ValidationFailed(CkptdError):
    """The rank manifests of a step do not form one consistent checkpoint."""

    code = "validation_failed"


class JobMismatch(ValidationFailed):
    code = "job_mismatch"


class StepMismatch(ValidationFailed):
    code = "step_mismatch"


class WorldSizeMismatch(ValidationFailed):
    code = "world_size_mismatch"


class DtypeMismatch(ValidationFailed):
    code = "dtype_mismatch"


class ShapeMismatch(ValidationFailed):
    code = "shape_mismatch"


class ShardOutOfBounds(ValidationFailed):
    code = "shard_out_of_bounds"


class TilingGap(ValidationFailed):
    code = "tiling_gap"


class TilingOverlap(ValidationFailed):
    code = "tiling_overlap"


class ReplicaMismatch(ValidationFailed):
    code = "replica_mismatch"


class ChunkLayoutMismatch(ValidationFailed):
    """Ranks of one step cut their tensors with different chunk sizes."""

    code = "chunk_layout_mismatch"


class MissingChunks(ValidationFailed):
    """A manifest or a step names chunks the store does not hold."""

    code = "missing_chunks"


# -- state conflicts (409) --------------------------------------------------------------


class Conflict(CkptdError):
    code = "conflict"


class AlreadyCommitted(Conflict):
    """A step is committed; its manifests can no longer change."""

    code = "already_committed"


class Superseded(Conflict):
    """A rank manifest saved in a timeline that a rollback has since ended: the
    rank must restore the rollback's step before its saves count again."""

    code = "superseded"


class RefConflict(Conflict):
    """A compare-and-swap of a ref lost against a concurrent writer."""

    code = "ref_conflict"


class NotCommitted(Conflict):
    """The step asked for exists but never committed."""

    code = "not_committed"


# -- the service and the transport (5xx and client side) ---------------------------------


class Unavailable(CkptdError, ConnectionError):
    """The server or the store could not be reached, after the retries."""

    code = "unavailable"


class Timeout(CkptdError, TimeoutError):
    code = "timeout"


class StoreError(CkptdError, OSError):
    code = "store_error"


class StoreFull(StoreError):
    """The store has no space left (ENOSPC, a quota), or too little for a new
    snapshot (refused before any of its bytes are sent): nothing half-written stays,
    and retrying will not help until an operator frees space."""

    code = "store_full"


class BodyTimeout(CkptdError, TimeoutError):
    """A request body that stopped arriving (a stalled or hostile client): 408, the
    client's slowness, not a bad request (400) nor the server's (504)."""

    code = "body_timeout"


class StoreCorrupt(StoreError):
    """A document in the store does not parse or contradicts its key: the store is
    damaged (not the caller's request). ``detail["key"]`` names the document."""

    code = "store_corrupt"


class UnsupportedStoredFormat(UnsupportedFormat):
    """A document in the store of a format version this ckptd does not know (a
    newer ckptd wrote it): the server's to upgrade, not the caller's request to fix
    (a 5xx, unlike ``unsupported_format`` for a document the caller sent), and not
    damage (nothing falls back around it, nothing replaces it).
    ``detail["key"]`` names the document."""

    code = "unsupported_stored_format"


class StagingError(StoreError):
    """The staging pool could not be created or grown (no memory left to map)."""

    code = "staging_failed"


class SnapshotSkipped(CkptdError):
    """A save was skipped because one was in flight and the policy says skip."""

    code = "snapshot_skipped"


class RestoreError(CkptdError):
    """A restore could not produce the committed state (named entries or chunks).
    ``detail["damaged"]`` True: the store itself lacks a chunk of the step or holds
    it wrong (damage: the command line's exit 1), not a source that failed."""

    code = "restore_failed"


class InvalidPolicy(InvalidRequest):
    """A policy file that does not parse or breaks the schema.

    ``line`` (1-based, or None when the file could not be read) and ``reason``
    name the first problem; ``detail["problems"]`` lists every one found.
    """

    code = "invalid_policy"

    @property
    def line(self) -> int | None:
        line = self.detail.get("line")
        return line if isinstance(line, int) else None

    @property
    def reason(self) -> str:
        return str(self.detail.get("reason", self.message))


class RollbackRequested(CkptdError):
    """The loss went non-finite: the job must go back to its last committed step.

    ``step`` is the step whose loss was non-finite; ``rollback_to`` the committed
    step to restore, when the raiser knows it. ``rollback_to`` None means the job
    has nothing committed, unless ``rollback_unknown`` is True: the server could not
    be asked which step it is, so restore the latest committed one.
    """

    code = "rollback_requested"

    def __init__(
        self, message: str, *, step: int | None = None, rollback_to: int | None = None,
        rollback_unknown: bool = False, **detail: Any,
    ) -> None:
        if step is not None:
            detail["step"] = step
        if rollback_to is not None:
            detail["rollback_to"] = rollback_to
        if rollback_unknown:
            detail["rollback_unknown"] = True
        super().__init__(message, **detail)

    @property
    def rollback_unknown(self) -> bool:
        """True when the step to go back to could not be learned (restore latest)."""
        return self.detail.get("rollback_unknown") is True

    @property
    def step(self) -> int | None:
        step = self.detail.get("step")
        return step if isinstance(step, int) else None

    @property
    def rollback_to(self) -> int | None:
        step = self.detail.get("rollback_to")
        return step if isinstance(step, int) else None


class GcInProgress(Unavailable):
    """A garbage collection sweep holds the store's GC lease; retry shortly."""

    code = "gc_in_progress"


HTTP_STATUS: dict[str, int] = {
    "internal": 500,
    "invalid_request": 400,
    "invalid_name": 400,
    "invalid_document": 400,
    "unsupported_format": 400,
    "unsupported_value": 400,
    "too_large": 413,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "chunk_not_found": 404,
    "manifest_not_found": 404,
    "checkpoint_not_found": 404,
    "job_not_found": 404,
    "integrity": 422,
    "chunk_hash_mismatch": 422,
    "chunk_size_mismatch": 422,
    "manifest_hash_mismatch": 422,
    "validation_failed": 409,
    "job_mismatch": 409,
    "step_mismatch": 409,
    "world_size_mismatch": 409,
    "dtype_mismatch": 409,
    "shape_mismatch": 409,
    "shard_out_of_bounds": 409,
    "tiling_gap": 409,
    "tiling_overlap": 409,
    "replica_mismatch": 409,
    "missing_chunks": 409,
    "chunk_layout_mismatch": 409,
    "conflict": 409,
    "already_committed": 409,
    "superseded": 409,
    "ref_conflict": 409,
    "not_committed": 409,
    "unavailable": 503,
    "timeout": 504,
    "store_error": 500,
    "snapshot_skipped": 409,
    "restore_failed": 500,
    "invalid_policy": 400,
    "staging_failed": 507,
    "rollback_requested": 409,
    "store_full": 507,
    "gc_in_progress": 503,
    "store_corrupt": 500,
    "body_timeout": 408,
    "unsupported_stored_format": 500,
    "unsupported_media_type": 415,
    "length_required": 411,
    "method_not_allowed": 405,
}


def _all_error_types() -> dict[str, type[CkptdError]]:
    found: dict[str, type[CkptdError]] = {}
    pending: list[type[CkptdError]] = [CkptdError]
    while pending:
        cls = pending.pop()
        found[cls.code] = cls
        pending.extend(cls.__subclasses__())
    return found


ERRORS_BY_CODE: dict[str, type[CkptdError]] = _all_error_types()


def http_status(code: str) -> int:
    return HTTP_STATUS.get(code, 500)


def from_json(body: dict[str, Any], fallback_status: int = 500) -> CkptdError:
    """Rebuild the typed error that a server sent as JSON."""
    code = str(body.get("code", "internal"))
    message = str(body.get("message", f"server error (HTTP {fallback_status})"))
    detail = body.get("detail") or {}
    cls = ERRORS_BY_CODE.get(code, CkptdError)
    err = cls(message)
    # Set, not passed as keywords: a detail key named "message" must not clash.
    err.detail = dict(detail) if isinstance(detail, dict) else {"detail": detail}
    return err
