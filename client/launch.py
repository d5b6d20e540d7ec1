"""Which launch of the job this process belongs to (its *incarnation*), stamped
on every rank manifest: a step commits only with manifests of one launch, and a
restarted launch's manifest replaces a dead launch's (docs/FORMAT.md, "Launches").

Every rank of one launch must name the same launch, or its steps never commit;
so only names that every rank of a launch sees alike are used."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ckptd.errors import InvalidRequest

ENV: str = "CKPTD_INCARNATION"
MAX_LENGTH = 256


def launch_incarnation(environ: Mapping[str, str] | None = None) -> str | None:
    """The launch named by the environment: ``CKPTD_INCARNATION``; else torchrun's run
    id and restart count when one agent runs every rank; else SLURM's job id and
    requeue count; None when no launch id is known."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV)
    if explicit:
        return check_incarnation(explicit)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:
        # TORCHELASTIC_RESTART_COUNT is each agent's own count: after one node's
        # workers fail, that node's agent counts a restart and the others restart as
        # a membership change, uncounted. Only a single agent's count names the launch.
        if env.get("GROUP_WORLD_SIZE", "1") != "1":
            return None
        return check_incarnation(
            f"torchelastic:{run_id}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    job_id = env.get("SLURM_JOB_ID")
    if job_id:  # a requeued job keeps its id and counts the requeue, job-wide
        return check_incarnation(f"slurm:{job_id}:{env.get('SLURM_RESTART_COUNT', '0')}")
    return None


def check_incarnation(incarnation: str) -> str:
    """``incarnation`` if it can name a launch (1 to 256 characters)."""
    if not isinstance(incarnation, str) or not 0 < len(incarnation) <= MAX_LENGTH:
        raise InvalidRequest(
            f"incarnation must be a string of 1 to {MAX_LENGTH} characters naming the "
            f"launch (every rank of one launch the same), not {str(incarnation)[:80]!r}")
    return incarnation
