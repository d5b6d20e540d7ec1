"""A failed save, said once and in Lightning's terms: the plugin raises it (from the
next save, load or ``teardown``, which ends ``fit``), with what to do as a
Lightning user does it. The ``Checkpointer``'s own log line for it, whose advice
names calls a Lightning user never makes (``save()``, ``step()``,
``handle.wait()``), is held back for the plugin's job (``QuietSaveFailures``)."""

from __future__ import annotations

import logging
from typing import Any

from ckptd.errors import (
    AlreadyCommitted,
    CkptdError,
    Forbidden,
    StoreFull,
    Timeout,
    Unauthorized,
    Unavailable,
)

# The Checkpointer logs a failed snapshot under this name (client/failures.py).
_CHECKPOINTER_LOG = "ckptd.client.checkpointer"


def _job_of(err: CkptdError) -> str | None:
    save = err.detail.get("save")
    job = save.get("job") if isinstance(save, dict) else None
    return job if isinstance(job, str) else None


class QuietSaveFailures(logging.Filter):
    """Drops the Checkpointer's log line of a failed save of ``job``: the plugin
    raises that failure itself, with Lightning's advice (``in_lightning_terms``)."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 4 and isinstance(args[1], CkptdError):
            return _job_of(args[1]) != self.job
        return True

    def install(self) -> None:
        logging.getLogger(_CHECKPOINTER_LOG).addFilter(self)

    def remove(self) -> None:
        logging.getLogger(_CHECKPOINTER_LOG).removeFilter(self)


def in_lightning_terms(err: BaseException, job: str, url: str) -> BaseException:
    """``err`` with what to do appended once, as a Lightning user does it (a save's
    failure: its message names the save, ``save of JOB step S rank 0 failed: ...``)."""
    if not isinstance(err, CkptdError) or err.detail.get("lightning_advice"):
        return err
    step = (err.detail.get("save") or {}).get("step") if isinstance(
        err.detail.get("save"), dict) else err.detail.get("step")
    advice = _advice(err, job, url, step)
    err.message = f"{err.message}; {advice}"
    err.args = (err.message,)
    err.detail["lightning_advice"] = True
    return err


def _advice(err: CkptdError, job: str, url: str, step: Any) -> str:
    resume = "fit(ckpt_path='last') resumes from the newest step that committed"
    if isinstance(err, AlreadyCommitted):
        return (f"step {step} of job {job} is stored already with other contents (steps are "
                "stored once, and this run did not resume from the newest one): resume with "
                f"ckpt_path='latest', or give this run a new job= in CkptdCheckpointIO")
    if isinstance(err, Unauthorized | Forbidden):
        role = err.detail.get("needs") if err.detail.get("needs") in ("admin",) else "write"
        return (f"pass CkptdCheckpointIO a token of role {role} on job {job} (ckptd token "
                f"create --job {job} --role {role}) as token= or CKPTD_TOKEN; {resume}")
    if isinstance(err, StoreFull):
        return f"free space in the store (ckptd forget {job}, then ckptd gc); {resume}"
    if isinstance(err, Unavailable | Timeout):
        return (f"check that the ckptd server at {url} is up and reachable (a larger "
                f"timeout= in CkptdCheckpointIO waits longer); {resume}")
    return f"that step is not stored; {resume}"
