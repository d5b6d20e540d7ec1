"""Failed snapshots are never silent: each is named (job, step, rank, then the
cause), logged at ERROR once with what to do, kept until the training loop sees it
(the next ``save()``, ``step()`` or ``close()`` raises it, or warns), counted in
``close()``'s result and reported in heartbeats."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ckptd.errors import (
    AlreadyCommitted,
    CkptdError,
    Forbidden,
    ReplicaMismatch,
    StoreFull,
    Superseded,
    Timeout,
    Unauthorized,
    Unavailable,
)

from .loop import ClientClosing

log = logging.getLogger("ckptd.client.checkpointer")


def wrap_error(exc: BaseException, what: str,
               kind: type[CkptdError] = CkptdError) -> CkptdError:
    """A typed error (``kind``) for anything that went wrong in the background."""
    if isinstance(exc, CkptdError):
        return exc
    err = kind(f"{what} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class SnapshotFailureWarning(UserWarning):
    """A snapshot failed and the checkpointer was made with ``on_error="warn"``."""


@dataclass(frozen=True, slots=True)
class CloseResult:
    """What a checkpointer's snapshots came to: ``saves`` staged, ``failed``
    (never committed by this rank's doing: the error was logged), ``skipped``
    (``on_busy="skip"``), the last failure's error, and ``pending``: the steps
    this rank saved whose commit was still undecided when it closed (other ranks'
    manifests not all in, or the server not answering in time), neither committed
    nor failed as far as this rank knows (``ckptd ls JOB`` says what came of them)."""

    saves: int
    failed: int
    skipped: int
    last_error: CkptdError | None = None
    pending: tuple[int, ...] = ()


def advice(exc: CkptdError, on_error: str = "raise") -> str:
    """What to do about a failed snapshot, in one line, and what comes of it under
    ``on_error``: raised by the loop's next call ("raise"), or training goes on."""
    if isinstance(exc, ReplicaMismatch):
        names = exc.detail.get("names") or [exc.detail.get("name")]
        names = [n for n in names if isinstance(n, str)]
        listed = ", ".join(repr(n) for n in names[:10]) or "..."
        return (f"tensors that differ between ranks on purpose (an RNG state, a per-rank "
                f"counter) must be saved rank-private: save(..., local=[{listed}]) "
                "(RNGState() is rank-local already)")
    if isinstance(exc, Superseded):
        return "the job was rolled back: restore the rollback's step, then save again"
    if isinstance(exc, Unauthorized):
        return (f"the server refused this token (revoked, or not one it knows): use a token "
                f"whose scope covers job {_job(exc)!r} with write access (ckptd token create "
                f"--job {_job(exc)} --role write), or the token the server was started with, "
                "as token= or CKPTD_TOKEN")
    if isinstance(exc, AlreadyCommitted) and exc.detail.get("abandoned"):
        return ("the path the job was rolled back from committed this step number, and a "
                "number commits once: this save is skipped, the new path's next new step "
                "number commits (to keep its steps apart, save at numbers the old path "
                "did not reach)")
    if isinstance(exc, AlreadyCommitted):
        return ("that step number is committed already (by an earlier run?): its manifests "
                "cannot change; save later steps under new numbers (resume after `latest`)")
    if isinstance(exc, ClientClosing):
        return ("the upload was interrupted before it committed: the step is not committed; "
                "a restore gets the last committed step")
    if isinstance(exc, Unavailable | Timeout):
        return ("check that the ckptd server is up and reachable; " + _goes_on(
            on_error, "training goes on, and saves fail until it answers"))
    if isinstance(exc, StoreFull):
        return (f"free space in the store (ckptd forget {_job(exc)}, then ckptd gc); " + _goes_on(
            on_error, "training goes on, and saves fail until there is room"))
    if isinstance(exc, Forbidden):
        return (f"this token may not write the job: pass one of role write on it (ckptd token "
                f"create --job {_job(exc)} --role write) as token= or CKPTD_TOKEN; " + _goes_on(
                    on_error, "training goes on, and saves fail"))
    return "this step is not committed; " + _goes_on(
        on_error, "training goes on, later saves are tried as usual")


def _job(exc: CkptdError) -> str:
    """The job a failed save was of (``name_save_error`` notes it), else ``JOB``."""
    save = exc.detail.get("save")
    job = save.get("job") if isinstance(save, dict) else exc.detail.get("job")
    return job if isinstance(job, str) else "JOB"


def _goes_on(on_error: str, warn: str) -> str:
    """What comes of a failed snapshot: ``warn``'s words under ``on_error="warn"``;
    under "raise" the loop's next call raises it, which ends a loop that does not
    catch it."""
    if on_error == "warn":
        return warn
    return ('the next save(), step() or close() raises this error, unless handle.wait() '
            'raised it (on_error="raise"; "warn" trains on)')


def name_save_error(exc: BaseException, job: str, step: int, rank: int) -> CkptdError:
    """``exc`` typed, its message naming the save first: ``save of JOB step S rank R
    failed: <cause>``. Named once (a typed error keeps its type)."""
    err = wrap_error(exc, "upload")
    if err.detail.get("save") is None:
        err.message = f"save of {job} step {step} rank {rank} failed: {err.message}"
        err.args = (err.message,)
        err.detail["save"] = {"job": job, "step": step, "rank": rank}
    return err


class FailureLog:
    """This rank's failed snapshots: counted, logged once, held until seen."""

    def __init__(self, job: str, rank: int, on_error: str = "raise") -> None:
        self.job = job
        self.rank = rank
        self.on_error = on_error  # what the advice says comes of a failure
        self.saves = 0
        self.skipped = 0
        self.failed = 0
        self.last: CkptdError | None = None
        self._unseen: CkptdError | None = None
        # What handle.wait() last raised: a snapshot's done-callback may record its
        # failure only after wait() returned, and must not hold it as unseen then.
        self._seen: BaseException | None = None
        # Snapshots (save serials) whose failure is recorded: several paths report
        # one failure (its done-callback, wait(), a save that waited for it, the
        # answers about its pending commit). Per snapshot, not per step: a step
        # number saved again (a rollback replays it) may fail again.
        self._snapshots: set[int] = set()
        self._lock = threading.Lock()

    def record(self, step: int, exc: BaseException, snapshot: int) -> CkptdError | None:
        """Notes that snapshot ``snapshot`` (its save serial) of ``step`` failed; the
        named error, or None when this snapshot's failure was recorded already."""
        err = name_save_error(exc, self.job, step, self.rank)
        # A save refused because a rollback ended its timeline is what a rollback
        # means, not a mistake: step() raises RollbackRequested for it already. So
        # is one of the new path at a step number the abandoned path committed: the
        # job replays those numbers, and must go on.
        superseded = isinstance(err, Superseded) or (
            isinstance(err, AlreadyCommitted) and bool(err.detail.get("abandoned")))
        with self._lock:
            if snapshot in self._snapshots:
                return None
            self._snapshots.add(snapshot)
            self.failed += 1
            self.last = err
            if not superseded and err is not self._seen:
                self._unseen = err
            # Logged under the lock: a second caller for this snapshot (wait() racing
            # the snapshot's done-callback) returns only once it is in the log.
            log.log(logging.WARNING if superseded else logging.ERROR,
                    "%s: %s [%s]\n  what to do: %s", type(err).__name__, err, err.code,
                    advice(err, self.on_error))
        return err

    def seen(self, exc: BaseException) -> None:
        """The loop saw ``exc`` (``handle.wait()`` raised it)."""
        with self._lock:
            self._seen = exc
            if self._unseen is exc:
                self._unseen = None

    def take(self) -> CkptdError | None:
        """The failure the loop has not seen yet (then it counts as seen)."""
        with self._lock:
            err, self._unseen = self._unseen, None
        return err

    def result(self, pending: tuple[int, ...] = ()) -> CloseResult:
        with self._lock:
            return CloseResult(self.saves, self.failed, self.skipped, self.last, pending)
