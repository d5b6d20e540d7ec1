"""Retention: which steps of a job to keep, and forgetting the rest.

A committed step is kept if any rule keeps it: one of the last ``keep_last``,
a multiple of ``keep_every``, committed within ``keep_within`` seconds, tagged,
``latest``, or the rollback target. Pending steps whose newest manifest is older
than ``abandon_pending_after`` are abandoned; a step whose commit record is
damaged, or lost (a ref names the step), is not pending but damaged, and stays
until ``forget_damaged_step`` (``ckptd forget JOB --step N``). Forgetting
removes the step's documents (commit record first: the step stops being a
checkpoint at once); its chunks go at the next garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import logging
import re
import secrets
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ckptd.errors import (
    CheckpointNotFound,
    InvalidDocument,
    InvalidPolicy,
    InvalidRequest,
    JobNotFound,
    NotFound,
    StoreCorrupt,
    StoreError,
)
from ckptd.format import (
    Ref,
    canonical_json,
    check_step,
    commit_key,
    latest_key,
    removal_key,
    step_prefix,
)
from ckptd.keys import JOB_RE
from ckptd.lifecycle.documents import damage_key
from ckptd.lifecycle.removals import REMOVAL_FORMAT, claim_since, newer_claim
from ckptd.lifecycle.reserve import with_room
from ckptd.lifecycle.tags import read_tags
from ckptd.repository import Repository

log = logging.getLogger(__name__)

DELETES_AT_ONCE = 64  # a step's documents are removed this many at a time

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_FIELDS = ("keep_last", "keep_every", "keep_within", "keep_tagged", "abandon_pending_after")
# What a retention file should look like, said when one does not.
_SHAPE = ("rules go in a [retention] table, e.g. `[retention]` then `keep_last = 5`, and "
          "[retention.jobs.<job>] per job (see docs/retention.md)")


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Rules for one job. No ``keep_*`` rule at all keeps everything."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_within: float | None = None
    keep_tagged: bool = True
    abandon_pending_after: float | None = None

    @property
    def forgets(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_within))


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """The server's retention: defaults, and per-job overrides."""

    default: RetentionPolicy = field(default_factory=RetentionPolicy)
    jobs: Mapping[str, RetentionPolicy] = field(default_factory=dict)

    def for_job(self, job: str) -> RetentionPolicy:
        return self.jobs.get(job, self.default)


def _as_toml(value: object) -> str:
    """``value`` as the policy file spells it (``true``, ``"2h"``), not as Python does."""
    if isinstance(value, bool | int | float | str):
        return json.dumps(value)
    return str(value)


def parse_duration(value: object, what: str) -> float:
    """Seconds from a number or a string like ``"90s"``, ``"2h"``, ``"7d"``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    m = _DURATION.match(value) if isinstance(value, str) else None
    if m is None:
        raise InvalidPolicy(f"{what}: {_as_toml(value)} is not a duration "
                            "(like 90, \"30m\", \"7d\")",
                            reason=f"{what} is not a duration")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _policy(table: Mapping[str, Any], base: RetentionPolicy, where: str,
            jobs: bool = False) -> RetentionPolicy:
    """``base`` with ``table``'s rules; ``jobs``: the [retention] table, where
    [retention.jobs.<job>] tables may sit too (said of an unknown key)."""
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        also = ", and [retention.jobs.<job>] tables per job" if jobs else ""
        near = [f"[retention.jobs.{_section(job)}]" for key in unknown
                if jobs and isinstance(table[key], dict)
                and difflib.get_close_matches(key, ["jobs"], cutoff=0.6)
                for job in table[key]]
        meant = f"; did you mean {', '.join(near)}?" if near else ""
        raise InvalidPolicy(f"{where}: unknown keys {unknown} (known: {', '.join(_FIELDS)}"
                            f"{also}){meant}", reason="unknown key")
    changes: dict[str, Any] = {}
    for name in ("keep_last", "keep_every"):
        if name in table:
            v = table[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidPolicy(f"{where}.{name} must be an integer >= 1, not {_as_toml(v)}",
                                    reason=f"{name} must be an integer >= 1")
            changes[name] = v
    for name in ("keep_within", "abandon_pending_after"):
        if name in table:
            changes[name] = parse_duration(table[name], f"{where}.{name}")
    if "keep_tagged" in table:
        if not isinstance(table["keep_tagged"], bool):
            raise InvalidPolicy(f"{where}.keep_tagged must be true or false",
                                reason="keep_tagged must be a boolean")
        changes["keep_tagged"] = table["keep_tagged"]
    return replace(base, **changes)


def parse_retention(text: str, source: str = "<string>") -> RetentionConfig:
    """A retention file: ``[retention]`` defaults and ``[retention.jobs.<job>]``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidPolicy(f"{source}: {exc}", reason=str(exc)) from None
    # A rule outside [retention] (a top-level keep_last) was once read as no rule at
    # all: a server then started with it and never forgot a step.
    unknown = sorted(set(data) - {"retention"})
    if unknown:
        raise InvalidPolicy(f"{source}: unknown top-level keys {unknown}; {_SHAPE}",
                            reason="unknown top-level key")
    table = data.get("retention", {})
    if not isinstance(table, dict):
        raise InvalidPolicy(f"{source}: [retention] must be a table", reason="not a table")
    jobs = table.pop("jobs", {})
    if not isinstance(jobs, dict):
        raise InvalidPolicy(f"{source}: retention.jobs must hold a table per job, as "
                            "[retention.jobs.<job>]", reason="not a table")
    for job, rules in jobs.items():
        # A section no job can match was accepted, and its rules never applied.
        if not JOB_RE.fullmatch(job):
            raise InvalidPolicy(
                f"{source}: [retention.jobs.{_section(job)}] names no job a store can hold "
                f"(a job name matches {JOB_RE.pattern}): fix the name or remove the section",
                reason="invalid job name")
        if not isinstance(rules, dict):
            raise InvalidPolicy(f"{source}: retention.jobs.{_section(job)} must be a table "
                                f"([retention.jobs.{_section(job)}])", reason="not a table")
    default = _policy(table, RetentionPolicy(), f"{source}: retention", jobs=True)
    config = RetentionConfig(default, {
        job: _policy(t, default, f"{source}: retention.jobs.{job}") for job, t in jobs.items()
    })
    if not any(p.forgets or p.abandon_pending_after is not None
               for p in (config.default, *config.jobs.values())):
        raise InvalidPolicy(f"{source} holds no retention rule; {_SHAPE}", reason="no rule")
    return config


def _section(job: str) -> str:
    """A job's name as a TOML section names it (quoted unless bare)."""
    if re.fullmatch(r"[A-Za-z0-9_-]+", job):
        return job
    return '"' + job.replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_retention(path: str | Path) -> RetentionConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidPolicy(f"cannot read retention file {path}: {exc.strerror}",
                            reason="unreadable") from None
    return parse_retention(text, str(path))


Decision = Literal["keep", "forget", "abandon", "pending"]


@dataclass(frozen=True, slots=True)
class StepDecision:
    step: int
    committed: bool
    decision: Decision
    reasons: tuple[str, ...]
    # What keeps a kept step, in the words of ``reasons``: the policy's rules that keep
    # it (``keep_last``, ``keep_every``, ``keep_within``, ``keep_tagged``), ``latest``,
    # ``rollback``, ``damaged`` or ``no_rule``; a caller says from it which rules kept what.
    kept_by: tuple[str, ...] = ()


def rules_of(policy: RetentionPolicy) -> dict[str, int | float | bool]:
    """``policy``'s rules as a retention file spells them (seconds for durations),
    those it sets."""
    rules: dict[str, int | float | bool] = {
        name: getattr(policy, name) for name in _FIELDS if getattr(policy, name) is not None}
    if policy.keep_tagged:  # (the default: said only when false)
        del rules["keep_tagged"]
    return rules


@dataclass(slots=True)
class ForgetPlan:
    job: str
    dry_run: bool
    steps: list[StepDecision] = field(default_factory=list)
    # Of ``forgotten``, the steps another pass was removing (another replica's
    # retention, a ``ckptd forget``): gone, but not by this one.
    elsewhere: list[int] = field(default_factory=list)

    @property
    def forgotten(self) -> list[int]:
        return [d.step for d in self.steps if d.decision in ("forget", "abandon")]


async def plan_forget(
    repo: Repository, job: str, policy: RetentionPolicy, *, now: float | None = None
) -> ForgetPlan:
    """What ``forget`` would do to ``job``'s steps, and why."""
    now = time.time() if now is None else now
    plan = ForgetPlan(job=job, dry_run=True)
    infos = await repo.list_steps(job)
    committed = sorted(i.step for i in infos if i.committed)
    last = set(committed[-policy.keep_last:]) if policy.keep_last else set()
    latest = await repo.latest_ref_step(job)
    intact = await repo.latest(job)  # what a restore of latest gets (scrub damage skipped)
    why_intact = ("newest undamaged (restore of latest)"
                  if latest is not None and await repo.store.exists(damage_key(job, latest))
                  else "restore of latest (a rollback went back to it)")
    marker, _ = await repo.rollback_state(job)
    tags = await read_tags(repo.store, job) if policy.keep_tagged else {}
    tagged: dict[int, list[str]] = {}
    for name, step in tags.items():
        tagged.setdefault(step, []).append(name)
    ages = await _pending_ages(repo, job, [i.step for i in infos
                                          if not i.committed and not i.damaged])
    for info in infos:
        step = info.step
        if not info.committed and info.damaged:
            # Its commit record is damaged or lost (a ref names it): a damaged step,
            # whose chunks may be the only copy, is the operator's to forget.
            plan.steps.append(StepDecision(step, False, "keep", (
                f"damaged, not abandoned (`ckptd forget {job} --step {step}` forgets it): "
                f"{info.damaged}",), ("damaged",)))
            continue
        if not info.committed:
            age = ages.get(step)
            if policy.abandon_pending_after is not None and age is not None and (
                    now - age > policy.abandon_pending_after):
                plan.steps.append(StepDecision(step, False, "abandon", (
                    f"pending for {now - age:.0f} s > {policy.abandon_pending_after:.0f} s",)))
            else:
                plan.steps.append(StepDecision(step, False, "pending", ("pending",)))
            continue
        kept: dict[str, str] = {}  # what keeps it -> in words
        if step == latest:
            kept["latest"] = "latest"
        elif step == intact:
            kept["latest"] = why_intact
        if marker is not None and step == marker.step:
            kept["rollback"] = "rollback target"
        if step in tagged:
            kept["keep_tagged"] = "tagged " + ", ".join(sorted(tagged[step]))
        if not policy.forgets:
            kept["no_rule"] = "no retention rule"
        if step in last:
            kept["keep_last"] = f"one of the last {policy.keep_last}"
        if policy.keep_every and step % policy.keep_every == 0:
            kept["keep_every"] = f"every {_ordinal(policy.keep_every)}"
        if policy.keep_within is not None and info.committed_at is not None and (
                now - info.committed_at <= policy.keep_within):
            kept["keep_within"] = f"younger than {policy.keep_within:.0f} s"
        if kept:
            plan.steps.append(StepDecision(step, True, "keep", tuple(kept.values()),
                                           tuple(kept)))
        else:
            plan.steps.append(StepDecision(step, True, "forget", ("no rule keeps it",)))
    return plan


async def _pending_ages(repo: Repository, job: str, steps: list[int]) -> dict[int, float]:
    """Pending step -> when its newest manifest was written (where the store says)."""
    out: dict[int, float] = {}
    for step in steps:
        times = [i.modified async for i in repo.store.list_info(f"{step_prefix(job, step)}ranks/")]
        if times and all(t is not None for t in times):
            out[step] = max(t for t in times if t is not None)
    return out


async def forget(
    repo: Repository,
    job: str,
    policy: RetentionPolicy,
    *,
    dry_run: bool = False,
    now: float | None = None,
    clock: Callable[[], float] = time.time,
) -> ForgetPlan:
    """Applies ``policy`` to ``job``: removes the documents of the steps it does not
    keep (chunks are freed by the next garbage collection)."""
    for name in ("keep_last", "keep_every"):  # 0 or fewer would forget every step
        n = getattr(policy, name)
        if n is not None and n < 1:
            raise InvalidRequest(f"{name} must be >= 1, not {n}")
    plan = await plan_forget(repo, job, policy, now=now if now is not None else clock())
    if not plan.steps:
        jobs = sorted(await repo.list_jobs())
        if job not in jobs:  # (a typo: "forgot 0 steps" said it went well)
            there = ("jobs there: " + ", ".join(jobs[:10]) + (", ..." if len(jobs) > 10 else "")
                     if jobs else "the store holds no jobs")
            raise JobNotFound(f"no job {job!r} to forget; {there}", job=job)
    plan.dry_run = dry_run
    if dry_run:
        return plan
    for i, d in enumerate(plan.steps):
        if d.decision == "forget":
            claim = await _claim(repo, job, d.step)
            if claim is None:
                plan.elsewhere.append(d.step)  # (another pass is removing it)
                continue
            # Tagged since the plan read the tags (a commit's retry): kept. A tag set
            # after this read finds the claim, and its writer takes it back.
            if policy.keep_tagged and d.step in (await read_tags(repo.store, job)).values():
                await _release(repo, job, d.step, claim)
                plan.steps[i] = StepDecision(d.step, True, "keep", ("tagged meanwhile",),
                                             ("keep_tagged",))
                continue
            # The record first: from then on the step is not a checkpoint, and a
            # crash leaves at worst a pending-looking step that the next run removes.
            # (Gone already: another pass removed it since this one planned; what it
            # left, if it stopped midway, goes now.)
            if not await repo.store.exists(commit_key(job, d.step)):
                plan.elsewhere.append(d.step)
            await repo.store.delete(commit_key(job, d.step))
            await _remove_step(repo, job, d.step, claim)
        elif d.decision == "abandon":
            await _abandon(repo, job, d.step)
    return plan


async def forget_damaged_step(
    repo: Repository, job: str, step: int, *, dry_run: bool = False
) -> ForgetPlan:
    """Forgets one damaged step (a document of it missing, unreadable or not the
    committed bytes, or marked by scrub), ``latest`` included: retention keeps
    ``latest`` whatever it holds, and one damaged manifest stops every garbage
    collection. ``latest`` then names the step a restore of it already gets, the
    newest usable one below. An intact step is refused: retention forgets those."""
    check_step(step)
    why = await _damage_of(repo, job, step)
    committed = await repo.store.exists(commit_key(job, step))
    plan = ForgetPlan(job=job, dry_run=dry_run,
                      steps=[StepDecision(step, committed, "forget", (why,))])
    if dry_run:
        return plan
    claim = await _claim(repo, job, step)
    if claim is not None:  # (None: another pass is removing it)
        await repo.store.delete(commit_key(job, step))  # first, as ``forget`` does
        await _remove_step(repo, job, step, claim)
    await _latest_below(repo, job, step)
    return plan


async def _damage_of(repo: Repository, job: str, step: int) -> str:
    """What is damaged in ``step``; ``InvalidRequest`` when nothing is."""
    try:
        record = await repo.try_read_commit(job, step)
    except StoreCorrupt as exc:
        return exc.message
    if record is not None:
        if await repo.store.exists(damage_key(job, step)):
            return f"marked damaged by scrub ({damage_key(job, step)})"
        damage = await repo.manifests_damage(record)
        if damage is not None:
            return damage[1]
    else:
        lost = (await repo.lost_commits(job)).get(step)
        if lost is not None:
            return lost
        ranks = await repo.ranks_present(job, step)
        if not ranks:
            raise CheckpointNotFound(f"no step {step} of {job} to forget; list its steps "
                                     f"with: ckptd ls {job}", job=job, step=step)
        for rank in ranks:  # a pending step: an unparseable manifest stops GC too
            try:
                await repo._read_manifest_raw(job, step, rank)
            except (StoreCorrupt, NotFound) as exc:
                return exc.message
    raise InvalidRequest(
        f"step {step} of {job} is intact: forget --step removes a damaged step only; "
        f"apply retention with: ckptd forget {job} --keep-last N", job=job, step=step)


async def _latest_below(repo: Repository, job: str, step: int) -> None:
    """Points ``latest``, where it names the forgotten ``step``, at the step a
    restore of it gets now (removed when no step is left); a commit that moved it
    meanwhile wins the swap."""
    key = latest_key(job)
    try:
        current = await repo.store.get(key)
        named = Ref.parse(current).step
    except (NotFound, InvalidDocument):  # (a damaged ref: the next commit replaces it)
        return
    if named != step:
        return
    left = await repo.step_numbers(job)
    if not any(await repo.store.exists_many([commit_key(job, s) for s in left])):
        with contextlib.suppress(StoreError):  # no checkpoint left: no latest
            await repo.store.compare_and_delete(key, current)
        return
    try:
        found = await repo.restorable_step(job)
    except StoreCorrupt as exc:  # every step left is damaged: those are to forget too
        log.warning("%s: latest still names forgotten step %d: %s", job, step, exc)
        return
    if found.step is None:
        return
    record = await repo.read_commit(job, found.step)
    ref = Ref(step=found.step, commit=record.digest()).canonical()
    if await with_room(repo.store, f"update {key}",
                       lambda: repo.store.compare_and_swap(key, current, ref)):
        log.warning("%s: latest moved back from forgotten step %d to step %d", job, step,
                    found.step)


# A removal claim this old is a dead pass's: another pass takes it over.
STALE_CLAIM = 600.0


async def _claim(repo: Repository, job: str, step: int) -> bytes | None:
    """Claims the removal of a step's documents (``removal_key``), or None when
    another retention pass holds the claim (it removes the step; this pass leaves
    it alone). A commit of the step that lands meanwhile (a late rank's, or a
    retry) waits until the claim goes, then stands only if every manifest is
    still there, else takes its record back and fails: no committed step ever
    lacks a manifest. The claim's bytes are this pass's own (a random token), so
    only this pass deletes it."""
    key = removal_key(job, step)
    mine = canonical_json({"format": REMOVAL_FORMAT, "version": 1, "since": time.time(),
                           "token": secrets.token_hex(16)})
    # (a full disk releases the store's reserve: forgetting is how space returns)
    if await with_room(repo.store, f"write {key}", lambda: repo.store.put_if_absent(key, mine)):
        return mine
    try:
        held = await repo.store.get(key)
    except NotFound:
        return None  # released meanwhile: the next pass looks again
    if (newer := newer_claim(held, key)) is not None:
        # A newer ckptd's pass: never taken over, however old (this pass leaves the
        # step to it, as to any pass that holds the claim).
        log.warning("%s step %d: left alone: %s", job, step, newer.message)
        return None
    # Unreadable (damaged): no live pass wrote it, so as good as stale; taken over by
    # a swap against its own bytes, which ``held`` still are.
    since = claim_since(held) or 0.0
    if time.time() - since < STALE_CLAIM:
        return None
    # A dead pass's claim: take it over (one pass wins the swap).
    taken = await with_room(repo.store, f"update {key}",
                            lambda: repo.store.compare_and_swap(key, held, mine))
    return mine if taken else None


async def _abandon(repo: Repository, job: str, step: int) -> bool:
    """Removes a pending step, unless it committed before the claim or another pass
    is removing it (False then)."""
    claim = await _claim(repo, job, step)
    if claim is None:
        return False
    if await repo.store.exists(commit_key(job, step)):
        await _release(repo, job, step, claim)
        log.info("%s step %d committed while retention meant to abandon it; kept", job, step)
        return False
    await _remove_step(repo, job, step, claim)
    return True


async def _release(repo: Repository, job: str, step: int, claim: bytes) -> None:
    """Deletes this pass's claim (only its own: compare-and-delete)."""
    try:
        await repo.store.compare_and_delete(removal_key(job, step), claim)
    except StoreError:  # a backend without an atomic delete: the claim is ours anyway
        await repo.store.delete(removal_key(job, step))


async def _remove_step(repo: Repository, job: str, step: int, claim: bytes) -> None:
    key = removal_key(job, step)
    # Twice: a commit whose record landed after the first listing takes it back
    # itself, unless it died first; the second listing removes what it left.
    for _ in range(2):
        keys = [k async for k in repo.store.list_prefix(step_prefix(job, step))]
        doomed = [k for k in keys if k != key] + [damage_key(job, step)]
        for start in range(0, len(doomed), DELETES_AT_ONCE):  # (a commit may be waiting)
            await asyncio.gather(*(repo.store.delete(k)
                                   for k in doomed[start:start + DELETES_AT_ONCE]))
    await _release(repo, job, step, claim)  # last: a commit waiting on it then decides


def _ordinal(n: int) -> str:
    """2nd, 3rd, 10th, 21st, 112th ("every 2th" was a retention reason's words)."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"

