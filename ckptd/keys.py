"""The store's names and keys (docs/FORMAT.md, "Names" and "Layout"): what a job,
a step, a rank and a chunk id may be, and where each document lies. Checked on
every path in, by the client and the server alike.
"""

from __future__ import annotations

import re

from ckptd.errors import InvalidName

JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHUNK_ID_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_STEP = 10**15
MAX_WORLD_SIZE = 1 << 20
# Names of numbers in URLs: one spelling each (no sign, no leading zero).
STEP_PATTERN = r"^(0|[1-9][0-9]{0,14})$"
RANK_PATTERN = r"^(0|[1-9][0-9]{0,6})$"


def check_job(job: str) -> str:
    if not isinstance(job, str) or not JOB_RE.fullmatch(job):
        raise InvalidName(
            f"job name {job!r} must match {JOB_RE.pattern} (letters, digits, '.', '_', '-')",
            job=str(job)[:200],
        )
    return job


def check_chunk_id(cid: str) -> str:
    if not isinstance(cid, str) or not CHUNK_ID_RE.fullmatch(cid):
        raise InvalidName(f"chunk id {str(cid)[:80]!r} is not 64 lowercase hex digits")
    return cid


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        hint = ""
        if not isinstance(step, bool | int) and hasattr(type(step), "__index__"):
            hint = f" (a {type(step).__module__}.{type(step).__name__}: pass int(step))"
        elif isinstance(step, str) and step.strip().lower() == "latest":
            # (The CLI's word for it; in Python the latest is no step at all.)
            hint = ": to restore or load the latest committed step, pass step=None"
        elif isinstance(step, str) and step.strip().isdigit():
            hint = " (a str: pass int(step))"
        raise InvalidName(f"step {step!r} must be an integer in [0, {MAX_STEP}){hint}")
    return step


def check_rank(rank: int, world_size: int, *, job: str | None = None) -> int:
    check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int):
        hint = " (e.g. int(os.environ['RANK']))" if isinstance(rank, str) else ""
        raise InvalidName(f"rank must be an int, not {type(rank).__name__} {rank!r}{hint}",
                          rank=repr(rank))
    if not 0 <= rank < world_size:
        of_job = f" of job {job!r}" if job is not None else ""
        raise InvalidName(
            f"rank {rank!r}{of_job} must be in [0, {world_size}): the world size is "
            f"{world_size}, so ranks are 0 to {world_size - 1} (check rank= and world_size=)",
            rank=rank, world_size=world_size, **({"job": job} if job is not None else {}),
        )
    return rank


def check_world_size(world_size: int) -> int:
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or not 1 <= world_size <= MAX_WORLD_SIZE
    ):
        raise InvalidName(f"world size {world_size!r} must be in [1, {MAX_WORLD_SIZE}]")
    return world_size


def chunk_key(cid: str) -> str:
    check_chunk_id(cid)
    return f"chunks/{cid[:2]}/{cid}"


def job_prefix(job: str) -> str:
    return f"jobs/{check_job(job)}/"


def step_prefix(job: str, step: int) -> str:
    return f"{job_prefix(job)}steps/{check_step(step)}/"


def manifest_key(job: str, step: int, rank: int) -> str:
    return f"{step_prefix(job, step)}ranks/{rank}.json"


def commit_key(job: str, step: int) -> str:
    return f"{step_prefix(job, step)}commit.json"


def removal_key(job: str, step: int) -> str:
    """Retention's claim on a step whose documents it removes (FORMAT.md,
    Lifecycle): a commit that lands meanwhile waits for it to go, then stands only
    if the step's manifests are all still there."""
    return f"{step_prefix(job, step)}removing.json"


def latest_key(job: str) -> str:
    return f"{job_prefix(job)}refs/latest"


def timeline_key(job: str) -> str:
    return f"{job_prefix(job)}refs/timeline"
