"""``ckptd forget``, ``gc``, ``scrub``, ``tag``, ``untag`` and ``space``: the store's
lifecycle, through a server (http://) or directly on a store (a path, file://, s3://)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import BaseModel
from rich.markup import escape
from rich.table import Table

from ckptd.cli import (
    DEFAULT_URL,
    TokenOpt,
    UrlOpt,
    _fail,
    _human,
    _server,
    app,
    console,
    err_console,
    step_number,
)
from ckptd.cli.exits import DAMAGE
from ckptd.cli.gc_runs import outcome, polled, spinner
from ckptd.cli.text import visible
from ckptd.errors import CkptdError, InvalidRequest, MethodNotAllowed, NotFound

if TYPE_CHECKING:
    from ckptd.client.transport_http import SyncTransport

DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Say what would go; change nothing.")]


def _remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _direct(url: str, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """Runs ``work(repository)`` on the store at ``url`` (no server)."""
    from ckptd.repository import Repository
    from ckptd.store import open_store

    async def go() -> Any:
        # (file:// URLs too; an s3:// prefix with nothing under it is refused as a
        # missing directory is: these commands never create a store)
        repo = Repository(open_store(url, direct=True, create=False))
        try:
            return await work(repo)
        finally:
            await repo.close()

    return asyncio.run(go())


def rollback_job(url: str, token: str | None, job: str, step: int | None,
                 reason: str) -> int | None:
    """An operator's rollback of ``job`` to ``step`` (None: clears the marker),
    through a server or on a store used directly: the step the ranks are told to go
    back to, or, clearing, the step the marker named (None: none was set). A job the
    store does not hold is ``JobNotFound`` naming those it does (clearing its marker
    said "cleared", a rollback "no checkpoint at step N")."""

    async def direct(repo: Any) -> int | None:
        if step is None:
            await _job_there(repo, job)
            marker, _ = await repo.rollback_state(job)
            await repo.clear_rollback(job)
            return None if marker is None else int(marker.step)
        done = await repo.set_rollback(job, step)
        return int(done.marker.step)

    def remote(server: SyncTransport) -> int | None:
        if step is None:
            _server_job_there(server, job, url)
            was: int | None = server.rollback(job).rollback_to
            server.clear_rollback(job)
            return was
        to: int | None = server.set_rollback(job, step, reason).rollback_to
        return to

    result: int | None = _run(url, token, remote, direct, job=job)
    return result


async def _job_there(repo: Any, job: str) -> None:
    """``JobNotFound`` naming the jobs there when the store holds no ``job``."""
    from ckptd.errors import job_not_found

    jobs = await repo.list_jobs()
    if job not in jobs:
        raise job_not_found(job, jobs, repo.store.describe())


def _server_job_there(server: SyncTransport, job: str, url: str) -> None:
    """``JobNotFound`` naming the jobs there (those its token reads) when it has no ``job``."""
    from ckptd.errors import job_not_found

    jobs = [j.job for j in server.jobs().jobs]
    if job not in jobs:
        raise job_not_found(job, jobs, url)


def _run(url: str, token: str | None, remote: Callable[[SyncTransport], Any],
         direct: Callable[[Any], Awaitable[Any]], job: str | None = None) -> Any:
    """``remote(server)`` through a server (its answer as JSON), or ``direct(repository)``
    on a store. ``job``: the job acted on; something of it not found, where the job
    itself is not there, is said as that (naming the jobs there)."""
    from ckptd.errors import JobNotFound, NotFound

    try:
        if _remote(url):
            with _server(url, token) as server:
                try:
                    answer = remote(server)
                except NotFound as exc:
                    if job is not None and not isinstance(exc, JobNotFound):
                        _server_job_there(server, job, url)
                    raise
                return answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer

        async def checked(repo: Any) -> Any:
            try:
                return await direct(repo)
            except NotFound as exc:
                if job is not None and not isinstance(exc, JobNotFound):
                    await _job_there(repo, job)
                raise

        return _direct(_existing(url), checked)
    except CkptdError as exc:
        _fail(exc)


def _existing(url: str) -> str:
    """``url`` when it is a server's or names a store that exists: these commands
    act on a store, and never create one at a mistyped path."""
    from ckptd.cli.mistakes import existing_store

    return url if _remote(url) else existing_store(url)


@app.command()
def forget(
    job: Annotated[str, typer.Argument(help="Job whose retention to apply.")],
    dry_run: DryRunOpt = False,
    keep_last: Annotated[int | None, typer.Option(min=1, help=(
        "Keep the last N steps (and the tagged, latest and rollback ones). Through a server "
        "with a retention file (or with --retention), N replaces its keep_last and its "
        "other rules still hold: the output names what they kept."))] = None,
    retention: Annotated[str | None, typer.Option(help="Retention TOML (direct store only).")
                         ] = None,
    step: Annotated[int | None, typer.Option(parser=step_number, metavar="STEP",
                                             help="Forget this damaged step only, latest "
                                             "too (what ckptd gc names).")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Apply a job's retention: forget the steps it does not keep (chunks go at the next gc)."""
    if step is not None and (keep_last is not None or retention is not None):
        _fail(InvalidRequest("--step forgets one damaged step: pass it without --keep-last "
                             "and --retention"))
    if retention is not None and _remote(url):
        _fail(InvalidRequest("--retention applies to a store (--url file:///path or s3://); "
                             "a server applies its own (ckptd serve --retention): pass "
                             "--keep-last N"))

    async def direct(repo: Any) -> Any:
        from ckptd.lifecycle.retention import (
            RetentionPolicy,
            forget_damaged_step,
            load_retention,
            rules_of,
        )
        from ckptd.lifecycle.retention import forget as apply

        if step is not None:
            plan = await forget_damaged_step(repo, job, step, dry_run=dry_run)
            return {"job": job, "dry_run": dry_run, "forgotten": plan.forgotten,
                    "steps": [dataclasses.asdict(d) for d in plan.steps]}
        policy = load_retention(retention).for_job(job) if retention else RetentionPolicy()
        if keep_last is not None:
            policy = dataclasses.replace(policy, keep_last=keep_last)
        if not policy.forgets and policy.abandon_pending_after is None:
            if retention:  # the file has rules, for other jobs only
                raise InvalidRequest(f"{retention} has no rule for {job} (its [retention] table "
                                     f"keeps every step): add [retention.jobs.{job}] or pass "
                                     "--keep-last N")
            raise InvalidRequest("no retention rule: pass --keep-last N or --retention FILE")
        plan = await apply(repo, job, policy, dry_run=dry_run)
        return {"job": job, "dry_run": dry_run, "forgotten": plan.forgotten,
                "steps": [dataclasses.asdict(d) for d in plan.steps], "rules": rules_of(policy)}

    def remote(server: SyncTransport) -> Any:
        return server.forget(job, dry_run, keep_last, step)

    plan = _run(url, token, remote, direct)
    table = Table("step", "state", "decision", "why")
    style = {"keep": "green", "forget": "red", "abandon": "red", "pending": "yellow"}
    for d in plan["steps"]:
        decision = d["decision"]
        table.add_row(str(d["step"]), _state(d, one_damaged=step is not None),
                      f"[{style[decision]}]{decision}[/]",
                      escape(visible("; ".join(d["reasons"]))))
    console.print(table)
    whose = "the server's retention" if _remote(url) else f"the retention of {retention}"
    for line in kept_by_retention(plan, keep_last is not None, whose):
        console.print(escape(line), highlight=False)
    verb = "would forget" if dry_run else "forgot"
    n = len(plan["forgotten"])
    console.print(f"{verb} {n} step{'' if n == 1 else 's'} of {escape(job)}: "
                  f"{plan['forgotten']}" + ("" if dry_run else " (run ckptd gc to free chunks)"))


def kept_by_retention(plan: dict[str, Any], own_keep_last: bool, whose: str) -> list[str]:
    """A line for each rule of a retention file (``plan["rules"]``, ``whose``) that
    alone kept steps: through a server, ``forget --keep-last 1`` kept steps 0, 10 and
    20 of a job its retention keeps every 10th of, and nothing said why (found by an
    operator's probe). ``own_keep_last``: keep_last was this command's, not the file's."""
    rules = {name: value for name, value in (plan.get("rules") or {}).items()
             if name.startswith("keep_") and not (own_keep_last and name == "keep_last")}
    lines = []
    for name, value in rules.items():
        steps = [d["step"] for d in plan["steps"] if d["decision"] == "keep"
                 and name in d.get("kept_by", ()) and set(d["kept_by"]) <= set(rules)]
        if steps:
            said = json.dumps(value) if isinstance(value, bool) else f"{value:g}"
            lines.append(f"kept by {whose} ({name} = {said}): "
                         + ", ".join(str(step) for step in steps))
    return lines


def _state(decision: dict[str, Any], one_damaged: bool) -> str:
    """A forget table's state of a step, in ``ckptd ls``'s words: a step ``forget
    --step`` forgets is damaged, and so is one not committed that retention keeps
    (a pending step is pending or abandoned; one kept is damaged, its commit record
    lost or unreadable: the plan's reasons say)."""
    if one_damaged or (not decision["committed"] and decision["decision"] in ("keep", "forget")):
        return "[red]damaged[/]"
    return "committed" if decision["committed"] else "pending"


@app.command()
def gc(
    dry_run: DryRunOpt = False,
    grace: Annotated[float | None, typer.Option(min=0, help="Seconds; longer than the longest save "
                                                "(server default, or 600 direct).")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Delete chunks no step names (safe while saves run; see docs/FORMAT.md)."""
    from ckptd.cli.gc_runs import collect_direct, collect_remote, print_report, say_stopped
    from ckptd.lifecycle.gc import GcProgress

    # A collection waits out its grace period (so saves in flight finish) before it
    # sweeps. Through a server it runs in the background and this follows it, so
    # no request lasts that long (a reverse proxy's read timeout would cut it).
    wait = "" if grace is None else f", after a {grace:g} s grace period"
    try:
        _existing(url)  # (before the grace period is announced)
    except CkptdError as exc:
        _fail(exc)
    if not dry_run and not _remote(url) and (grace is None or grace > 0):
        err_console.print(f"collecting garbage: waits out a {600.0 if grace is None else grace:g}"
                          " s grace period first (saves in flight finish meanwhile)",
                          highlight=False, soft_wrap=True)
    doing = "collecting garbage" + (" (dry run)" if dry_run else "") + wait
    progress = GcProgress()
    try:
        r = _run(url, token, lambda server: collect_remote(server, dry_run, grace, doing),
                 lambda repo: collect_direct(repo, dry_run, grace, doing, progress))
    except KeyboardInterrupt:  # (Ctrl-C, or SIGTERM: ckptd/__main__.py) of a direct run
        say_stopped(progress, dry_run)
        raise typer.Exit(code=130) from None
    print_report(r, dry_run)


@app.command()
def scrub(
    budget: Annotated[int | None, typer.Option(min=0, help="Bytes to read (default: a whole pass).")
                      ] = None,
    replica: Annotated[str | None, typer.Option(help="A replica store to repair from "
                                                "(direct store only).")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Re-hash stored chunks, oldest-verified first; repair or mark damaged steps.
    It checks the chunks in the store (`ckptd verify JOB` finds those missing), and
    exits 1 when it reports damage. Through a server it runs there, followed here
    (Ctrl-C stops following, not the scrub)."""
    if replica is not None and _remote(url):
        _fail(InvalidRequest("--replica applies to a store (--url file:///path or s3://); a "
                             "server repairs from its live peers and CKPTD_SCRUB_REPLICA"))
    try:
        replica_url = None if replica is None else _replica(replica)
    except CkptdError as exc:
        _fail(exc)

    async def direct(repo: Any) -> Any:
        from ckptd.lifecycle.scrub import scrub as run
        from ckptd.lifecycle.scrub import store_source

        if replica is None or replica_url is None:
            return dataclasses.asdict(await run(repo, budget_bytes=budget))
        copy = await _holding_chunks(replica, replica_url)
        try:
            return dataclasses.asdict(await run(repo, budget_bytes=budget,
                                                sources=[store_source(copy)]))
        finally:
            await copy.close()

    # Through a server the scrub runs in the background and this follows it: a whole
    # pass at the server's CKPTD_SCRUB_RATE outlasts a reverse proxy's read timeout.
    def remote(server: SyncTransport) -> Any:
        from ckptd.client import calls

        try:
            before = server.run(calls.scrub_status()).running
        except MethodNotAllowed:  # a server from before scrub runs: the one long call
            return server.run(calls.scrub(budget))
        run = server.run(calls.start_scrub(budget))
        try:
            if before is not None and before.id == run.id:
                err_console.print(
                    f"a scrub is already under way on the server ({_budget(run.budget_bytes)}"
                    + ("" if run.budget_bytes == budget else f", not {_budget(budget)} asked")
                    + "); following it", highlight=False, soft_wrap=True)
            with spinner("scrubbing on the server") as status:
                return _follow_scrub(server, run, status)
        except KeyboardInterrupt:
            err_console.print(f"interrupted: scrub {run.id} goes on on the server; `ckptd scrub` "
                              "again follows it", highlight=False, soft_wrap=True)
            raise typer.Exit(code=130) from None

    with contextlib.nullcontext() if _remote(url) else console.status("scrubbing"):
        r = _run(url, token, remote, direct)
    console.print(f"checked {r['chunks_checked']} chunks ({_human(r['bytes_checked'])}) in "
                  f"{r['seconds']:.2f} s: those in the store (`ckptd verify JOB` finds the "
                  "missing ones)")
    unreadable = set(r.get("unreadable", []))  # (an older server does not say)
    for cid in r["corrupt"]:
        word = ("[green]repaired" if cid in r["repaired"] else
                "[bold red]unreadable" if cid in unreadable else "[bold red]corrupt")
        console.print(f"{word}[/] {cid}", soft_wrap=True)
    for job, steps in r["damaged"].items():
        console.print(f"[bold red]damaged[/] {escape(job)} steps {steps} (restore of latest "
                      "skips them)")
    for job, steps in r.get("whole_again", {}).items():  # (an older server does not say)
        console.print(f"[green]whole again[/] {escape(job)} steps {steps} (chunks good now)")
    documents = r.get("damaged_documents", [])  # (an older server does not say)
    for doc in documents:  # ("damaged document KEY: what is wrong; what became of it")
        console.print(escape(visible(doc)), soft_wrap=True, highlight=False)
    if len(r["corrupt"]) > len(r["repaired"]) or r["damaged"] or documents:
        raise typer.Exit(code=DAMAGE)


# Seconds between progress lines where stderr is no terminal (a log keeps each line).
PROGRESS_EVERY = 10.0


def _budget(budget: int | None) -> str:
    return "a whole pass" if budget is None else f"a {_human(budget)} budget"


def _follow_scrub(server: SyncTransport, run: Any, status: Any) -> Any:
    """Polls the server until the background scrub ``run`` ended, saying how far it
    is; its report (or its typed error, raised)."""
    from ckptd.client import calls

    wait, line_at, listed = 0.05, 0.0, False
    while True:
        now = polled(lambda: server.run(calls.scrub_status()))
        if (report := outcome(now, run, "scrub", "`ckptd scrub` again starts one")
                ) is not None:
            return report
        at = now.running
        said = ("scrubbing on the server: listing the store's chunks" if at.chunks_total is None
                else f"scrubbing on the server: {at.chunks_checked} of {at.chunks_total} chunks "
                f"checked ({_human(at.bytes_checked)}"
                + ("" if at.budget_bytes is None else f" of a {_human(at.budget_bytes)} budget")
                + f"), {at.corrupt} corrupt")
        status.update(said)
        # (off a terminal: a line now and then, and one as soon as the chunks are listed)
        if not err_console.is_terminal and (time.monotonic() >= line_at
                                            or listed != (at.chunks_total is not None)):
            err_console.print(said, highlight=False, soft_wrap=True)
            line_at, listed = time.monotonic() + PROGRESS_EVERY, at.chunks_total is not None
        time.sleep(wait)
        wait = min(1.0, wait * 2)


def _replica(replica: str) -> str:
    """The store URL ``--replica`` names; a path where no directory is, refused:
    scrub repairs from a copy of the store and never creates one."""
    from urllib.parse import urlparse

    from ckptd.cli.mistakes import store_url

    if replica.startswith(("http://", "https://")):
        raise InvalidRequest(f"--replica {replica} is a server: --replica names a copy of "
                             "the store (a directory, file:///path or s3://bucket/prefix)")
    url = store_url(replica)
    path = Path(urlparse(url).path)
    if url.startswith("file://") and not path.is_dir():
        raise NotFound(f"--replica {replica}: no store at {path} "
                       f"({'a file' if path.exists() else 'no such directory'}); name a copy "
                       "of this store to repair from (scrub never creates one)")
    return url


async def _holding_chunks(replica: str, url: str) -> Any:
    """The store ``--replica`` names, open; ``NotFound`` (exit 2) when no chunk lies
    under it: a wrong bucket, prefix or directory repaired nothing, and the scrub
    then marked damaged the steps it could have repaired, or said nothing at all."""
    from ckptd.store import open_store

    store = open_store(url, create=False)
    try:
        held = await store.list_dir("chunks/")  # (one listing, not every chunk)
    except NotFound:  # an s3:// prefix with nothing under it
        held = []
    except BaseException as exc:
        await store.close()
        if isinstance(exc, CkptdError) and exc.detail.get("s3_code") == "NoSuchBucket":
            # (not the store URL's bucket, and not one to create: an empty one
            # repairs nothing either)
            raise NotFound(f"--replica {replica}: {exc.message}; name a copy of this store "
                           "to repair from", replica=replica) from None
        raise
    if not held:
        await store.close()
        raise NotFound(f"--replica {replica}: no chunks are stored there (a wrong bucket, "
                       "prefix or directory?); name a copy of this store to repair from",
                       replica=replica)
    return store


@app.command()
def tag(
    job: Annotated[str, typer.Argument()],
    step: Annotated[int, typer.Argument(parser=step_number, metavar="STEP")],
    name: Annotated[str, typer.Argument(help="Tag name; retention keeps tagged steps.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Tag a committed step so that retention keeps it (a tag on another step moves)."""

    # The step the tag was on, read first, to say that it moves (a damaged tags
    # document is the tag's own store_corrupt error, said by the write).
    async def direct(repo: Any) -> int | None:
        from ckptd.lifecycle.tags import read_tags

        was = None
        with contextlib.suppress(CkptdError):
            was = (await read_tags(repo.store, job)).get(name)
        await repo.tag(job, name, step)
        return was

    def remote(server: SyncTransport) -> int | None:
        from ckptd.client import calls

        was = None
        with contextlib.suppress(CkptdError):
            was = server.run(calls.tags(job)).get(name)
        server.tag(job, name, step)
        return was

    was = _run(url, token, remote, direct, job=job)
    if was is not None and was != step:
        console.print(f"moved tag {escape(name)!r} of {escape(job)}: step {was} -> step {step}")
    else:
        console.print(f"tagged step {step} of {escape(job)} {escape(name)!r}")


@app.command()
def untag(
    job: Annotated[str, typer.Argument()], name: Annotated[str, typer.Argument()],
    url: UrlOpt = DEFAULT_URL, token: TokenOpt = None,
) -> None:
    """Remove a tag (the step is then kept only if a retention rule keeps it)."""

    async def direct(repo: Any) -> Any:
        from ckptd.errors import NotFound
        from ckptd.lifecycle.tags import read_tags, remove_tag

        if not await remove_tag(repo.store, job, name):
            raise NotFound(f"{job} has no tag {name!r}")
        return await read_tags(repo.store, job)

    _run(url, token, lambda server: server.untag(job, name), direct, job=job)
    console.print(f"removed tag {escape(name)!r} of {escape(job)}")


# Seconds ``ckptd space`` asks a server again while its census is still counting.
SPACE_PATIENCE = 5.0
# A server's listing of chunks/ older than this (s) is said with its age.
LISTING_AGE_SAID = 90.0


@app.command()
def space(url: UrlOpt = DEFAULT_URL, token: TokenOpt = None) -> None:
    """Bytes stored per job, bytes unique to each step, dedup ratio and space left.
    Exit 1 when a damaged document kept a step from being counted."""

    async def direct(repo: Any) -> Any:
        from ckptd.lifecycle.census import census

        s = await census(repo)
        out = dataclasses.asdict(s)
        for j, js in zip(out["jobs"], s.jobs, strict=True):
            j["dedup_ratio"] = js.dedup_ratio
        return out

    def remote(server: SyncTransport) -> Any:
        # A server counts in the background and says when it is not done (just
        # started on a large store): ask again for a few seconds before showing it.
        deadline = time.monotonic() + SPACE_PATIENCE
        while True:
            answer = server.space()
            if answer.complete or time.monotonic() >= deadline:
                return answer
            time.sleep(0.5)

    s = _run(url, token, remote, direct)
    table = Table("job", "step", "logical", "unique (freed if forgotten)", "stored", "dedup")
    for j in s["jobs"]:
        ratio = f"{j['dedup_ratio']:.2f}x" if j["dedup_ratio"] else "-"
        table.add_row(escape(j["job"]), "all", _human(j["logical_bytes"]), "",
                      _human(j["stored_bytes"]), ratio)
        for st in j["steps"]:
            table.add_row("", str(st["step"]), _human(st["logical_bytes"]),
                          _human(st["unique_bytes"]), "", "")
    console.print(table)
    free = s["free_bytes"]
    console.print(f"chunks in store: {s['chunks']} ({_human(s['chunk_bytes'])}); space left: "
                  + (f"{_human(free)} of {_human(s['total_bytes'])}" if free is not None
                     else "not reported by this store"))
    if s.get("unreferenced_chunks") is not None:  # (an older server does not say)
        console.print(f"named by no committed step: {s['unreferenced_chunks']} chunks "
                      f"({_human(s['unreferenced_bytes'])}): what `ckptd gc` deletes, but "
                      "for those of saves under way")
    listed = s.get("chunks_listed_at")
    if listed is not None and s["taken_at"] - listed > LISTING_AGE_SAID:
        console.print(f"(chunks/ last listed {(s['taken_at'] - listed) / 60:.0f} min ago: a "
                      "chunk stored since is counted once a step names it)")
    for damage in s.get("damaged", []):  # (an older server does not say)
        console.print(f"not counted, damaged: {escape(visible(damage))}")
    if not s.get("complete", True):  # (an older server does not say)
        console.print(f"still counting: {s.get('uncounted_steps', 0)} committed steps not "
                      "counted yet" + ("" if s.get("chunks_listed_at") else
                                       ", chunks/ not listed yet")
                      + (", chunks/ listed again (steps were forgotten before they were "
                         "counted: their chunks are not in the count yet)"
                         if s.get("listing_again") else "") + "; ask again shortly")
    if s.get("damaged"):  # damage found: not a clean answer (as ls and verify)
        raise typer.Exit(code=DAMAGE)
