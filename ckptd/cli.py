"""The ``ckptd`` command line.

The CLI is the one place in the core that reaches into ``ckptd.server`` (for
``serve``) and ``ckptd.client`` (for commands that talk to a server); it imports
them inside the commands, so ``import ckptd`` stays free of both."""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ckptd import __version__
from ckptd.errors import CkptdError

app = typer.Typer(
    name="ckptd",
    help="Asynchronous, deduplicated, verified checkpoints for distributed PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

UrlOpt = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="CKPTD_URL",
        help="http://host:port of a ckptd server, or file:///path of a store directory.",
    ),
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="CKPTD_TOKEN", help="Bearer token.")
]
DEFAULT_URL = "http://127.0.0.1:8470"


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _fail(exc: CkptdError) -> None:
    err_console.print(f"[bold red]error[/] [{exc.code}] {exc.message}")
    raise typer.Exit(code=2)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"ckptd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True)
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def serve(
    store: Annotated[
        str | None,
        typer.Option(help="Store directory (or file:///path, memory://). Env CKPTD_STORE."),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind. Env CKPTD_HOST.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind. Env CKPTD_PORT.")] = None,
    token: Annotated[
        str | None, typer.Option(help="Require this bearer token. Env CKPTD_TOKEN.")
    ] = None,
    replica_mismatch: Annotated[
        str | None,
        typer.Option(help="'reject' (default) or 'warn' when data-parallel replicas differ."),
    ] = None,
) -> None:
    """Run the checkpoint server over a store."""
    from ckptd.server.app import run
    from ckptd.server.settings import Settings

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "store": store,
            "host": host,
            "port": port,
            "token": token,
            "replica_mismatch": replica_mismatch,
        }.items()
        if v is not None
    }
    logging.getLogger("ckptd").setLevel(logging.INFO)
    run(Settings(**overrides))


def _transport(url: str, token: str | None) -> Any:
    from ckptd.client.transport import open_transport

    return open_transport(url, token=token)


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


@app.command("ls")
def ls(
    job: Annotated[str | None, typer.Argument(help="Show this job's steps.")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """List jobs, or one job's steps with sizes and whether each committed."""

    async def go() -> None:
        transport = _transport(url, token)
        try:
            if job is None:
                jobs = await transport.list_jobs()
                table = Table("job", "latest", "committed", "pending", "size of latest")
                for j in jobs:
                    name = _field(j, "job")
                    steps = await transport.list_steps(name)
                    committed = [s for s in steps if _field(s, "committed")]
                    latest = next((s for s in steps if _field(s, "is_latest")), None)
                    table.add_row(
                        name,
                        str(_field(latest, "step")) if latest else "-",
                        str(len(committed)),
                        str(len(steps) - len(committed)),
                        _human(_field(latest, "logical_bytes") if latest else None),
                    )
                console.print(table)
            else:
                steps = await transport.list_steps(job)
                table = Table("step", "state", "ranks", "size", "committed at (UTC)", "")
                for s in steps:
                    committed = _field(s, "committed")
                    world = _field(s, "world_size")
                    table.add_row(
                        str(_field(s, "step")),
                        "[green]committed[/]" if committed else "[yellow]pending[/]",
                        f"{_field(s, 'ranks_present')}/{world if world is not None else '?'}",
                        _human(_field(s, "logical_bytes")),
                        _when(_field(s, "committed_at")),
                        "latest" if _field(s, "is_latest") else "",
                    )
                console.print(table)
        finally:
            await transport.close()

    try:
        asyncio.run(go())
    except CkptdError as exc:
        _fail(exc)


@app.command()
def verify(
    job: Annotated[str, typer.Argument(help="Job to verify.")],
    step: Annotated[
        int | None, typer.Argument(help="Step (default: every committed step).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Re-hash every chunk of a job's committed checkpoints; exit 1 naming bad ones."""

    async def go() -> Any:
        transport = _transport(url, token)
        try:
            return await transport.verify(job, step)
        finally:
            await transport.close()

    try:
        with console.status(f"verifying {job}" + (f" step {step}" if step is not None else "")):
            report = asyncio.run(go())
    except CkptdError as exc:
        _fail(exc)
        return
    bad = list(_field(report, "bad_chunks"))
    missing = list(_field(report, "missing_chunks"))
    bad_manifests = list(_field(report, "bad_manifests"))
    console.print(
        f"checked {_field(report, 'chunks_checked')} chunks "
        f"({_human(_field(report, 'bytes_checked'))}) of {job} steps {_field(report, 'steps')}"
    )
    for cid in bad:
        console.print(f"[bold red]corrupt[/] chunk {cid}")
    for cid in missing:
        console.print(f"[bold red]missing[/] chunk {cid}")
    for m in bad_manifests:
        console.print(f"[bold red]bad manifest[/] {m}")
    if bad or missing or bad_manifests:
        raise typer.Exit(code=1)
    console.print("[green]ok[/]: every chunk matches its id")


@app.command()
def demo(
    workdir: Annotated[
        str | None, typer.Option(help="Keep the store and logs here (default: a temp dir).")
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 40,
    nproc: Annotated[int, typer.Option(help="Ranks.")] = 2,
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


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
