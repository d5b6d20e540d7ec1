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
import threading
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta

from ckptd.errors import InvalidRequest

log = logging.getLogger(__name__)

ENV: str = "CKPTD_INCARNATION"
MAX_LENGTH = 256
# The key of the group's launch id in the default process group's store.
GROUP_KEY = "ckptd/launch"
# The key of a torchrun agent's id in its own store (``agent_launch``).
AGENT_KEY = "ckptd/agent"
# Agent ids already asked for, by the store's address (a DCP writer asks every save).
_agents: dict[tuple[str, str], str | None] = {}
_agents_lock = threading.Lock()


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
        # The run id repeats when the same command is run again (a fixed --rdzv-id; a
        # pod restart), and each new agent counts from 0: what this agent put in its
        # own store, which dies with it, tells its launches from another agent's.
        agent = agent_launch(env)
        return check_incarnation(
            f"torchelastic:{run_id[:100]}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            + (f":{agent}" if agent else ""))
    job_id = env.get("SLURM_JOB_ID")
    if job_id:  # a requeued job keeps its id and counts the requeue, job-wide
        return check_incarnation(f"slurm:{job_id}:{env.get('SLURM_RESTART_COUNT', '0')}")
    return None


def heartbeat_launch(environ: Mapping[str, str] | None = None,
                     given: str | None = None) -> Callable[[], str | None]:
    """For a heartbeat told no launch: this launch's id as it is known now, asking no
    store as it beats (a heartbeat must not wait on one). The environment's launch is
    read once, here (``launch_incarnation`` without the group: under torchrun the
    process's first such read asks the agent's store, ``agent_launch``, at most 10 s,
    and keeps its answer); the id the ranks agreed on as
    ``ckptd.client.distributed.init_process_group`` formed the group wins once there
    is one. Only ranks of one launch must name it alike: it need not be the id that
    manifests carry. ``given`` (``Checkpointer(incarnation=)``) is the launch where
    neither names one (a launcher of one's own)."""
    from .distributed import agreed_launch

    try:
        known = launch_incarnation(environ, group=False)
    except InvalidRequest:  # a malformed CKPTD_INCARNATION: the checkpointer says so
        known = None

    def current() -> str | None:
        agreed = agreed_launch()
        if agreed is not None:
            return f"group:{agreed}"[:MAX_LENGTH]
        return known if known is not None else given

    return current


def group_initialized() -> bool:
    """True when this process's default process group exists."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


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


def agent_launch(environ: Mapping[str, str] | None = None) -> str | None:
    """An id of this process's torchrun agent, the same for every worker it starts
    and restarts and another for every agent process: the first worker to ask puts
    a fresh one in the agent's store (``TORCHELASTIC_USE_AGENT_STORE``: it lives as
    long as the agent) by compare-and-set. None without that store, or when it
    cannot be reached (logged)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # (else MASTER_PORT is a worker's store, there only with a group)
    where = (env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""))
    with _agents_lock:
        if where in _agents:
            return _agents[where]
        agreed: str | None = None
        try:
            import torch.distributed as dist

            store = dist.TCPStore(  # type: ignore[attr-defined]
                where[0], int(where[1]), is_master=False, timeout=timedelta(seconds=10),
                wait_for_workers=False)
            agreed = bytes(store.compare_set(AGENT_KEY, "", uuid.uuid4().hex)).decode()
        except Exception as exc:  # no launch id rather than one the other ranks lack
            log.info("cannot reach torchrun's agent store at %s:%s for a launch id: %s",
                     where[0], where[1], exc)
        _agents[where] = agreed
        return agreed


def check_incarnation(incarnation: str) -> str:
    """``incarnation`` if it can name a launch (1 to 256 characters)."""
    if not isinstance(incarnation, str) or not 0 < len(incarnation) <= MAX_LENGTH:
        raise InvalidRequest(
            f"incarnation must be a string of 1 to {MAX_LENGTH} characters naming the "
            f"launch (every rank of one launch the same), not {str(incarnation)[:80]!r}")
    return incarnation
