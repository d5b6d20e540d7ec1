"""The ``ckptd`` command line.

The CLI is the one place in the core that reaches into ``ckptd.server`` (for
``serve``) and ``ckptd.client`` (for commands that talk to a server); it imports
them inside the commands, so ``import ckptd`` stays free of both.

Commands of one flow live in their own module of this package (``lifecycle``,
``views``, ...) and register themselves on ``app`` when imported at the bottom
of this file.

Past the house's ~500 lines on purpose: the ``app``, the options and helpers every
command module imports, and the first commands, kept here in ``ckptd --help``'s
order (a command moved to a module would move in that list)."""

from __future__ import annotations

import asyncio
import datetime as _dt
import enum
import os
import shlex
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from ckptd import __version__
from ckptd.cli.exits import exit_code
from ckptd.cli.help import HelpGroup
from ckptd.cli.logs import command_logging, server_logging
from ckptd.cli.options import (  # (shared with the commands' modules)
    DEFAULT_URL,
    ServerUrlOpt,
    TokenOpt,
    UrlOpt,
    step_number,
    step_or_latest,
)
from ckptd.cli.text import visible
from ckptd.cli.variables import say_unknown_variables
from ckptd.errors import CkptdError
from ckptd.format import check_job
from ckptd.knobs import human_bytes

if TYPE_CHECKING:
    from ckptd.client.transport_http import SyncTransport

app = typer.Typer(
    name="ckptd",
    help="Asynchronous, deduplicated, verified checkpoints for distributed PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: flags without a <bool> placeholder, nothing cut at 80 columns.
    rich_markup_mode=None,
    cls=HelpGroup,
)
# Messages are not broken at 80 columns: a path or URL in them stays whole (to copy,
# or to grep in a log); a terminal wraps long lines itself. Tables still fit.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

__all__ = ["DEFAULT_URL", "ServerUrlOpt", "TokenOpt", "UrlOpt", "app", "step_number",
           "step_or_latest"]


def _human(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _fail(exc: CkptdError) -> None:
    # Escaped: "[code]" and the message are text, not rich markup; its lines kept, and
    # control characters in them (a tenant's words, echoed) written out.
    message = "\n".join(visible(line) for line in exc.message.split("\n"))
    err_console.print(f"[bold red]error[/] {escape(f'[{exc.code}] {message}')}", soft_wrap=True)
    if exc.detail.get("unreached"):
        err_console.print("is a ckptd server running there? Start one with `ckptd serve "
                          "--store DIR`, or name yours with --url or CKPTD_URL",
                          soft_wrap=True, highlight=False, markup=False)
    elif exc.code == "unauthorized":
        err_console.print("pass a token the server accepts with --token or CKPTD_TOKEN",
                          soft_wrap=True, highlight=False, markup=False)
    elif exc.detail.get("s3_code") == "NoSuchBucket":  # (ckptd never creates a bucket)
        err_console.print("check the bucket in the store URL (s3://bucket/prefix, and its "
                          "?endpoint=), or create the bucket first",
                          soft_wrap=True, highlight=False, markup=False)
    raise typer.Exit(code=exit_code(exc))  # 1: damage found; 2: could not run


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"ckptd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True,
                     help="Print the version and exit."),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    command_logging(verbose)
    plain_off_a_terminal(console, err_console)
    say_unknown_variables(os.environ)  # (every command: serve's, and a client's CKPTD_URLS)


PLAIN_WIDTH = 10_000  # "unbounded": a table off a terminal is as wide as its rows


def plain_off_a_terminal(*consoles: Console) -> None:
    """Off a terminal (a pipe, a log file, ``kubectl logs``) each line is a record:
    rich would wrap it at 80 columns and split paths and URLs across lines. There,
    lines are never wrapped (``COLUMNS`` still wins when set)."""
    if os.environ.get("COLUMNS"):
        return
    for c in consoles:
        if not c.is_terminal:
            c.soft_wrap = True
            c.width = PLAIN_WIDTH


# What serve's options default to (server.settings.Settings, not imported here: the
# CLI loads the server only to serve); tests check that the two agree.
SERVE_DEFAULTS = {"store": "./ckptd-store", "host": "127.0.0.1", "port": "8470"}


class ReplicaMismatchMode(enum.StrEnum):
    """What the server does when data-parallel replicas differ (its allowed values)."""

    reject = "reject"
    warn = "warn"


@app.command()
def serve(
    store: Annotated[
        str | None,
        typer.Option(help="Store directory (or file:///path, memory://, s3://bucket/prefix). "
                     f"Env CKPTD_STORE.  [default: {SERVE_DEFAULTS['store']}]"),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(help=f"Address to bind. Env CKPTD_HOST.  [default: {SERVE_DEFAULTS['host']}]"),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(min=0, max=65535,
                     help=f"Port to bind. Env CKPTD_PORT.  [default: {SERVE_DEFAULTS['port']}]"),
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="Require this bearer token. Env CKPTD_TOKEN.")
    ] = None,
    replica_mismatch: Annotated[
        ReplicaMismatchMode | None,
        typer.Option(help="'reject' (default) or 'warn' when data-parallel replicas differ. "
                     "Env CKPTD_REPLICA_MISMATCH."),
    ] = None,
    heartbeat_interval: Annotated[
        float | None,
        typer.Option(help="Seconds between rank heartbeats (2). Env CKPTD_HEARTBEAT_INTERVAL."),
    ] = None,
    dead_after: Annotated[
        int | None,
        typer.Option(help="Missed heartbeat intervals before a rank is dead (3). "
                     "Env CKPTD_DEAD_AFTER."),
    ] = None,
    snapshot_lead: Annotated[
        int | None,
        typer.Option(help="Least steps past the fastest rank a coordinated snapshot is set "
                     "(2; raised from the ranks' step times). Env CKPTD_SNAPSHOT_LEAD."),
    ] = None,
    snapshot_min_interval: Annotated[
        float | None,
        typer.Option(help="Seconds between accepted snapshot requests of a job (30). "
                     "Env CKPTD_SNAPSHOT_MIN_INTERVAL."),
    ] = None,
    tls_cert: Annotated[
        str | None,
        typer.Option(help="Serve https:// with this PEM certificate (chain). Env CKPTD_TLS_CERT."),
    ] = None,
    tls_key: Annotated[
        str | None,
        typer.Option(help="The certificate's PEM private key. Env CKPTD_TLS_KEY."),
    ] = None,
    access_log: Annotated[
        bool | None,
        typer.Option("--access-log/--no-access-log",
                     help="Log every request (on). Env CKPTD_ACCESS_LOG."),
    ] = None,
    tokens_file: Annotated[
        str | None,
        typer.Option(help="Scoped tokens (ckptd token create). Env CKPTD_TOKENS_FILE."),
    ] = None,
    peer_networks: Annotated[
        str | None,
        typer.Option(help="CIDRs heartbeats' peer URLs may point into besides their own "
                     "address, or 'any'. Env CKPTD_PEER_NETWORKS."),
    ] = None,
    retention: Annotated[
        str | None, typer.Option(help="Retention TOML (docs/retention.md), applied after commits. "
                               "Env CKPTD_RETENTION.")
    ] = None,
    gc_interval: Annotated[
        float | None, typer.Option(help="Seconds between background GC runs (0: off). "
                                   "Env CKPTD_GC_INTERVAL.")
    ] = None,
    gc_grace: Annotated[
        float | None, typer.Option(help="GC grace period, longer than the longest save (600). "
                                   "Env CKPTD_GC_GRACE.")
    ] = None,
    scrub_interval: Annotated[
        float | None, typer.Option(help="Seconds between background scrub runs (0: off). "
                                   "Env CKPTD_SCRUB_INTERVAL.")
    ] = None,
    peers: Annotated[
        str | None,
        typer.Option(help="Every replica's URL, comma-separated. Env CKPTD_PEERS."),
    ] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(help="The URL clients reach this replica at. Env CKPTD_ADVERTISE_URL."),
    ] = None,
    member_leases: Annotated[
        bool | None,
        typer.Option("--member-leases/--no-member-leases",
                     help="Find replicas by leases in the store. Env CKPTD_MEMBER_LEASES."),
    ] = None,
    single_writer: Annotated[
        bool | None,
        typer.Option("--single-writer/--no-single-writer",
                     help="Serve a store that cannot write conditionally, as its only writer "
                     "(docs/SECURITY.md). Env CKPTD_SINGLE_WRITER."),
    ] = None,
    check: Annotated[
        bool,
        typer.Option("--check", help="Check the settings and that the store writes "
                     "conditionally, then exit (0: it would serve)."),
    ] = False,
) -> None:
    """Run the checkpoint server over a store (the dashboard is at /, metrics at /metrics)."""
    from ckptd.cli.mistakes import checked_serve
    from ckptd.server.app import run

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "store": store,
            "host": host,
            "port": port,
            "token": token,
            "replica_mismatch": replica_mismatch.value if replica_mismatch else None,
            "heartbeat_interval": heartbeat_interval,
            "dead_after": dead_after,
            "snapshot_lead": snapshot_lead,
            "snapshot_min_interval": snapshot_min_interval,
            "access_log": access_log,
            "tokens_file": tokens_file,
            "peer_networks": peer_networks,
            "tls_cert": tls_cert,
            "tls_key": tls_key,
            "retention": retention,
            "gc_interval": gc_interval,
            "gc_grace": gc_grace,
            "scrub_interval": scrub_interval,
            "peers": peers,
            "advertise_url": advertise_url,
            "member_leases": member_leases,
            "single_writer": single_writer,
        }.items()
        if v is not None
    }
    try:
        settings, opened = checked_serve(overrides, check)
    except CkptdError as exc:
        _fail(exc)
        return
    if isinstance(opened, str):  # (what --check says)
        console.print(escape(opened), highlight=False)
        return
    server_logging()
    run(settings, store=opened)


def _transport(url: str, token: str | None) -> Any:
    """A server (http://), or a store read in this process (file://, s3://), at
    ``reached``'s URL: called inside the command's loop."""
    from ckptd.client.transport import open_transport

    return open_transport(url, token=token, create=False)


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


@app.command("ls")
def ls(
    job: Annotated[str | None, typer.Argument(help="Show this job's steps.")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """List jobs, or one job's steps with sizes, tags and whether each committed. A job or
    step whose documents cannot be read is listed as such, and the exit code is 1
    (damaged: `ckptd verify JOB` names every damaged document; or a newer ckptd
    wrote them)."""
    from ckptd.cli.listing import Notes, jobs_table, steps_table
    from ckptd.cli.servers import reached

    notes = Notes()  # one job's unreadable documents: told, not fatal

    async def go() -> None:
        transport = _transport(url, token)
        try:
            if job is None:
                console.print(await jobs_table(transport, notes))
            else:
                console.print(await steps_table(transport, job, notes))
        finally:
            await transport.close()

    try:
        url = reached(url, token)  # (before the loop: Ctrl-C ends its wait)
        asyncio.run(go())
    except CkptdError as exc:
        _fail(exc)
    notes.print(err_console)
    if notes.newer or notes.damaged:
        # Too old to read all of it (upgrade), or damage listed: not a clean answer.
        raise typer.Exit(code=1)


@app.command()
def verify(
    job: Annotated[str, typer.Argument(help="Job to verify.")],
    step: Annotated[
        int | None, typer.Argument(parser=step_number, metavar="STEP",
                                   help="Step (default: every committed step).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Check a job's refs, commit records, manifests and chunks; exit 1 naming what
    is damaged and which steps, ranks and tensors it breaks."""
    from ckptd.cli.servers import reached

    bar = transfer_bar()
    task = bar.add_task(f"verifying {job}" + (f" step {step}" if step is not None else ""),
                        total=None)

    def on_bytes(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    async def go() -> Any:
        from ckptd.errors import NotFound

        transport = _transport(url, token)
        try:
            return await transport.verify(job, step, on_bytes=on_bytes)
        except NotFound:
            if await transport.list_steps(job):
                raise
            from ckptd.errors import job_not_found  # a job not there: name those there

            jobs = [_field(j, "job") for j in await transport.list_jobs()]
            raise job_not_found(job, jobs, transport.describe()) from None
        finally:
            await transport.close()

    try:
        url = reached(url, token)  # (before the loop: Ctrl-C ends its wait)
        with bar:
            report = asyncio.run(go())
    except CkptdError as exc:
        _fail(exc)
        return
    problems = 0
    console.print(
        f"checked {_field(report, 'chunks_checked')} chunks "
        f"({_human(_field(report, 'bytes_checked'))}) of {job} steps {_field(report, 'steps')}"
    )
    for ref in report.get("bad_refs", []):
        problems += 1
        console.print(f"[bold red]bad ref[/] {escape(ref)}")
    for record in report.get("bad_commits", []):
        problems += 1
        console.print(f"[bold red]bad commit record[/] {escape(record)}")
    for doc in report.get("unreadable", []):  # a newer ckptd's: not damage, not checked
        problems += 1
        console.print(f"[bold yellow]not checked[/] {escape('[unsupported_stored_format]')} "
                      f"{escape(doc)}")
    for m in _field(report, "bad_manifests"):
        problems += 1
        console.print(f"[bold red]bad manifest[/] {escape(m)}")
    for d in report.get("damage", []):
        problems += 1
        breaks = ", ".join(
            f"step {u['step']} rank {u['rank']} {escape(visible(u['tensor']))}"
            for u in d["breaks"][:10]
        )
        more = f" and {len(d['breaks']) - 10} more" if len(d["breaks"]) > 10 else ""
        console.print(f"[bold red]{d['problem']}[/] chunk {d['chunk']}: breaks {breaks}{more}")
    named = {d["chunk"] for d in report.get("damage", [])}
    for cid in [*_field(report, "bad_chunks"), *_field(report, "missing_chunks")]:
        if cid not in named:  # (a server without the damage list)
            problems += 1
            console.print(f"[bold red]bad[/] chunk {cid}")
    if problems or not _field(report, "ok"):
        raise typer.Exit(code=1)
    console.print("[green]ok[/]: refs, commit records, manifests and every chunk check out")


def _server(url: str, token: str | None) -> SyncTransport:
    """The server of a command that needs one, not a store (a ``SyncTransport``:
    each job's calls go to its home replica). One try per call, 10 s each."""
    from ckptd.cli.mistakes import server_url
    from ckptd.cli.servers import check_servers
    from ckptd.client.transport_http import SyncTransport

    return SyncTransport(check_servers(server_url(url), token), token, timeout=10.0, retries=0)


@app.command()
def rollback(
    job: Annotated[str, typer.Argument(help="The job.")],
    step: Annotated[
        int | None, typer.Argument(parser=step_number, metavar="STEP",
                                   help="A committed step the job must go back to.")
    ] = None,
    clear: Annotated[
        bool, typer.Option("--clear", help="Clear the job's rollback marker.")
    ] = False,
    reason: Annotated[
        str, typer.Option(help="Why (shown in status and the dashboard).")
    ] = "manual",
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Tell every rank of a job to go back to a committed step (or --clear that). On a
    store used directly, it also replaces a damaged timeline (docs/FORMAT.md)."""
    if clear == (step is not None):
        err_console.print("[bold red]error[/] give a STEP, or --clear (not both)")
        raise typer.Exit(code=2)
    from ckptd.cli.lifecycle import rollback_job
    from ckptd.cli.mistakes import check_reason

    try:
        check_job(job)
        check_reason(reason)
    except CkptdError as exc:
        _fail(exc)
    to = rollback_job(url, token, job, step, reason)
    if clear:  # (it said "cleared" of a marker that was never set)
        console.print(f"rollback of [bold]{job}[/] to step {to} cleared" if to is not None
                      else f"no rollback of [bold]{job}[/] is set: nothing to clear")
    else:
        # (with the --url given: the advice without it went to the default server)
        where = "" if url in (DEFAULT_URL, os.environ.get("CKPTD_URL")) else (
            f" --url {shlex.quote(url)}")
        console.print(f"[bold]{job}[/]: ranks are told to roll back to step {to} (clear with "
                      f"`ckptd rollback {job} --clear{escape(where)}`)")


@app.command()
def restore(
    job: Annotated[str, typer.Option("--job", help="Job to restore.")],
    rank: Annotated[int, typer.Option("--rank", min=0, help="Rank whose shard to fetch.")],
    to: Annotated[str, typer.Option("--to", help="Local directory store to fill.")],
    step: Annotated[
        int | None, typer.Option("--step", parser=step_or_latest, metavar="STEP",
                                 help="Committed step, or latest (default: latest).")
    ] = None,
    peers: Annotated[bool, typer.Option(help="Fetch from live peers first.")] = True,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Pre-fetch a rank's committed chunks into a local directory (an init container
    or a new node); a restore then reads them with cache_dir=DIR (or CKPTD_CACHE_DIR)."""
    from ckptd.cli.mistakes import existing_store, rank_of_restore, restore_target, unknown_job
    from ckptd.cli.servers import check_servers

    try:
        restore_target(to)
        url = check_servers(existing_store(url), token)
        from ckptd.client.restore import restore_command  # (torch: after the mistakes)

        result = restore_command(url, job, rank, to, step=step, token=token, peers=peers,
                                 console=console)
    except CkptdError as exc:
        _fail(rank_of_restore(unknown_job(exc, url, token, job)))
        return
    except KeyboardInterrupt:
        err_console.print(f"interrupted: the restore into {escape(to)} did not finish; run the "
                          "same command again", soft_wrap=True)
        raise typer.Exit(code=130) from None
    tiers = ", ".join(f"{tier} {_human(n)}" for tier, n in result.bytes_from.items() if n)
    console.print(
        f"[green]ok[/]: step {result.step} of {job} rank {rank}: {result.chunks} chunks, "
        f"{_human(result.bytes)} in {result.seconds:.1f}s into {result.directory}"
        + (f" ({tiers})" if tiers else "")
    )
    from ckptd.cli.restore_report import restore_notes

    for line in restore_notes(result.problems, result.step):
        console.print(line, soft_wrap=True)


policy_app = typer.Typer(help="Health policies (see docs/policy.md).", no_args_is_help=True,
                         rich_markup_mode=None, cls=HelpGroup)
app.add_typer(policy_app, name="policy")


@policy_app.command("check")
def policy_check(
    file: Annotated[str, typer.Argument(help="A policy TOML file.")],
) -> None:
    """Validate a policy file and print the effective policy (defaults merged)."""
    from ckptd.client.health.policy_file import check_command

    code, text = check_command(file)
    if code == 0:
        console.print(text, markup=False, highlight=False)
    else:
        err_console.print(text, markup=False, highlight=False)
    raise typer.Exit(code=code)


@app.command()
def demo(
    workdir: Annotated[
        str | None, typer.Option(help="A new or empty directory for the store and logs "
                                 "(default: a temp dir).")
    ] = None,
    steps: Annotated[int, typer.Option(min=10, help="Training steps.")] = 40,
    nproc: Annotated[int, typer.Option(min=2, help="Ranks.")] = 2,
) -> None:
    """Train a small model on 2 CPU ranks, kill one mid-run, recover, compare."""
    from ckptd.client.demo import run_demo

    ok = run_demo(workdir=workdir, steps=steps, nproc=nproc, console=console)
    raise typer.Exit(code=0 if ok else 1)


def progress_bar() -> Progress:
    """The rich progress bar long commands share."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def transfer_bar() -> Progress:
    """The bar of a command whose answer is a report after it (verify, export): bytes
    and rate, gone when done; none off a terminal, where rich ends a bar with a blank
    line (the first line of the report, in a pipe or a log)."""
    from rich.progress import TransferSpeedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
        disable=not console.is_interactive,
    )


# Command modules: each adds its commands to ``app`` on import.
# (one line per module; keep this block above main())
from ckptd.cli import healthcheck as _healthcheck  # noqa: E402,F401  (the image's HEALTHCHECK)
from ckptd.cli import lifecycle as _lifecycle  # noqa: E402,F401  (forget, gc, scrub, tag)
from ckptd.cli import shm as _shm  # noqa: E402,F401  (staging pools in /dev/shm)
from ckptd.cli import status as _status  # noqa: E402,F401
from ckptd.cli import tokens as _tokens  # noqa: E402,F401
from ckptd.cli import views as _views  # noqa: E402,F401  (export, import, diff)


def main() -> None:
    from ckptd.cli.mistakes import run_app

    try:
        sys.exit(run_app(app))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
