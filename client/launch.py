"""Which launch of the job this process belongs to (its *incarnation*), stamped
on every rank manifest: a step commits only with manifests of one launch, and a
restarted launch's manifest replaces a dead launch's (docs/FORMAT.md, "Launches").

Every rank of one launch must name the same launch, or its steps never commit;
so only names that every rank of a launch sees alike are used: one given, one
the ranks of the process group agreed on (through its store, no collective), or
one the launcher's environment holds alike on every rank."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping

from ckptd.errors import InvalidRequest

log = logging.getLogger(__name__)

ENV: str = "CKPTD_INCARNATION"
MAX_LENGTH = 256
# The key of the group's launch id in the default process group's store.
GROUP_KEY = "ckptd/launch"


def launch_incarnation(environ: Mapping[str, str] | None = None, *,
                       group: bool = True) -> str | None:
    """This launch's id: the one the ranks of this process's group agreed on
    (``group_launch``; ``group=False`` skips it), after ``CKPTD_INCARNATION`` when
    that is set (torchrun restarts workers with the environment it started them
    with, so a variable cannot tell its launches apart: the group's id does);
    else ``CKPTD_INCARNATION``; else torchrun's run id and restart count when one
    agent runs every rank; else SLURM's job id and requeue count; None when no
    launch id is known."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV)
    if explicit:
        check_incarnation(explicit)
    agreed = group_launch(env) if group else None
    if agreed is not None:
        return check_incarnation(f"{explicit[:200]}/{agreed}" if explicit else agreed)
    if explicit:
        return explicit
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


def group_launch(environ: Mapping[str, str] | None = None) -> str | None:
    """The launch id the ranks of this process's default process group agree on, or
    None without one. A group made by ``ckptd.client.distributed.init_process_group``
    agreed on one as it met. Otherwise, when the group's store is a TCP store of this
    launch alone (worker rank 0 hosts it: not torchrun's shared agent store, which
    outlives launches), the first rank to ask puts a fresh id there by
    compare-and-set and every rank reads that one: no collective, so a rank that
    asks early or late, or never, holds nobody up."""
    import torch.distributed as dist

    from .distributed import agreed_launch

    if not (dist.is_available() and dist.is_initialized()):
        return None
    agreed = agreed_launch()
    if agreed is not None:
        return check_incarnation(f"group:{agreed}")
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # the agent's store outlives the launch: a key there would too
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # a torch without it, or no default group
        log.debug("no store of the default process group: %s", exc)
        return None
    under = store
    while isinstance(under, dist.PrefixStore):  # type: ignore[attr-defined]
        under = under.underlying_store  # (torch nests one per group level)
    if not isinstance(under, dist.TCPStore):  # type: ignore[attr-defined]
        return None  # a file store may outlive the launch
    try:  # (asked again, it answers the id it holds)
        raw = store.compare_set(GROUP_KEY, "", uuid.uuid4().hex)
    except Exception as exc:  # the store's host is gone: no id rather than two
        log.info("cannot agree on a launch id through the process group's store: %s", exc)
        return None
    return check_incarnation(f"group:{bytes(raw).decode()}")


def check_incarnation(incarnation: str) -> str:
    """``incarnation`` if it can name a launch (1 to 256 characters)."""
    if not isinstance(incarnation, str) or not 0 < len(incarnation) <= MAX_LENGTH:
        raise InvalidRequest(
            f"incarnation must be a string of 1 to {MAX_LENGTH} characters naming the "
            f"launch (every rank of one launch the same), not {str(incarnation)[:80]!r}")
    return incarnation
