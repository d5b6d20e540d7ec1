"""A person's mistakes on the command line: one or two lines that say what was
wrong and what is allowed, exit code 2, never a traceback."""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from ckptd.errors import CkptdError, InvalidRequest, JobNotFound, NotFound, StoreError

try:  # typer carries its own copy of click since 0.2x; the errors are that copy's
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on click itself
    from click import exceptions as click_errors  # type: ignore[no-redef]

if TYPE_CHECKING:
    from ckptd.server.settings import Settings
    from ckptd.store import Store

# The exit code of every usage mistake (click's, and ckptd's own `_fail`).
USAGE = 2
# Up to this many jobs are named when a job is not found; more are counted.
JOBS_NAMED = 10


def run_app(app: typer.Typer) -> int:
    """Runs the CLI; a usage mistake prints one or two plain lines on stderr."""
    from ckptd.cli import err_console

    try:
        result = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as exc:
        print(exc.ctx.get_help())  # noqa: T201 - the CLI's help text
        return USAGE
    except click_errors.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "ckptd"
        err_console.print(f"[bold red]error[/] {escape(exc.format_message())}", soft_wrap=True)
        err_console.print(f"see `{escape(where)} --help`", highlight=False)
        return USAGE
    except click_errors.ClickException as exc:
        err_console.print(f"[bold red]error[/] {escape(exc.format_message())}", soft_wrap=True)
        return exc.exit_code
    except typer.Abort:
        return 130
    except CkptdError as exc:  # a command that forgot to catch its own
        err_console.print(f"[bold red]error[/] {escape(f'[{exc.code}] {exc.message}')}",
                          soft_wrap=True)
        return USAGE
    return result if isinstance(result, int) else 0


def server_settings(overrides: dict[str, Any]) -> tuple[Settings, Store]:
    """``ckptd serve``'s settings (options over ``CKPTD_*``) and its store, opened
    before the server starts: a bad value or store is one line, not a traceback
    from inside uvicorn."""
    import pydantic

    from ckptd.server.settings import Settings
    from ckptd.store import open_store

    try:
        settings = Settings(**overrides)
    except pydantic.ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "?"
            option = f"--{name.replace('_', '-')}"
            source = option if name in overrides else f"CKPTD_{name.upper()}"
            if not error["loc"]:  # a rule over several settings
                problems.append(error["msg"].removeprefix("Value error, ").replace("_", "-"))
                continue
            problems.append(f"{source}: {error['msg']} (got {error.get('input')!r})")
        raise InvalidRequest("; ".join(problems)) from None
    if settings.tls_cert is not None and settings.tls_key is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                settings.tls_cert, settings.tls_key
            )
        except (OSError, ssl.SSLError) as exc:
            raise InvalidRequest(
                f"--tls-cert {settings.tls_cert} / --tls-key {settings.tls_key}: cannot load "
                f"them as a PEM certificate and its key: {exc}"
            ) from None
    _check_server_files(settings)
    return settings, open_store(settings.store)


def _check_server_files(settings: Settings) -> None:
    """The retention file, the peers and the tokens file, read as the server will read
    them: a mistake there is one line now, not a traceback from uvicorn's lifespan."""
    from ckptd.cluster import parse_urls
    from ckptd.lifecycle.retention import load_retention

    if settings.retention is not None:
        load_retention(settings.retention)
    tokens = None if settings.tokens_file is None else Path(settings.tokens_file)
    if tokens is not None and tokens.is_file():
        from ckptd.tokens import TokenFile

        try:  # (read as the server reads it: --check said ok for a file serve refused)
            TokenFile(tokens)
        except CkptdError as exc:
            raise InvalidRequest(f"--tokens-file {tokens}: {exc.message}; write it with "
                                 "`ckptd token create ... --file FILE`") from None
    if tokens is not None and not tokens.is_file():
        # A server over no tokens file answers 401 to every request until one is
        # written there (it reads the file again when it changes): a directory that
        # is not there is a mistake; a file not written yet may be the plan.
        if not tokens.parent.is_dir():
            raise InvalidRequest(f"--tokens-file {tokens}: no such file; create it with "
                                 "`ckptd token create --job JOB --role ROLE --file FILE`")
        from ckptd.cli import err_console

        err_console.print(f"[yellow]warning[/] --tokens-file {escape(str(tokens))} is not "
                          "there yet: every request is refused (401) until `ckptd token "
                          "create ... --file` writes it", soft_wrap=True)
    if settings.peers is not None:
        try:
            parse_urls(settings.peers)
        except InvalidRequest as exc:
            raise InvalidRequest(f"--peers: {exc.message}; give every replica's URL, "
                                 "comma-separated (http://a:8470,http://b:8470)") from None


def writable_store(settings: Settings, store: Store) -> Store:
    """``store`` if it writes conditionally (``ckptd.store.probe``); else, for a
    single writer (``--single-writer``), wrapped so that this process checks the
    conditions; else ``StoreError`` naming the store and what it lacks."""
    import asyncio

    from ckptd.store.probe import conditional_write_gaps
    from ckptd.store.single_writer import SingleWriterStore

    async def probe() -> list[str]:
        try:
            return await conditional_write_gaps(store)
        finally:
            await store.close()  # (its client belongs to this loop; the server opens its own)

    gaps = asyncio.run(probe())
    if not gaps:
        return store
    lacks = "; ".join(gaps)
    if not settings.single_writer:
        raise StoreError(
            f"store {store.describe()} cannot write conditionally: {lacks}.\nTwo writers "
            "(ranks committing at once, replicas) could both win: use a store that honours "
            "If-None-Match and If-Match, or --single-writer if this server is its only writer",
            store=store.describe(), lacks=gaps)
    if settings.peers or settings.member_leases:
        raise InvalidRequest("--single-writer: this server must be the store's only writer, "
                             "so it cannot run with --peers or --member-leases")
    from ckptd.cli import err_console

    err_console.print(f"[yellow]warning[/] store {escape(store.describe())} cannot write "
                      f"conditionally ({escape(lacks)}); serving it as its single writer: "
                      "no other server or client may write to it", soft_wrap=True)
    return SingleWriterStore(store)


def existing_store(url: str) -> str:
    """``url`` unchanged when it is not a local path, or names a store directory that
    exists: a reading command never creates a store where none was."""
    from ckptd.cluster import parse_url

    parsed = parse_url(url)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise InvalidRequest(f"file URL {url!r} names a host ({parsed.netloc}); a store "
                             "directory is file:///absolute/path (three slashes)")
    if parsed.scheme in ("file", "") and parsed.path:  # (a bare path is a local store)
        path = Path(parsed.path)
        if not path.is_dir():
            raise NotFound(
                f"no store at {path} ({'a file' if path.exists() else 'no such directory'}); "
                "check --url (this command never creates a store)"
            )
        if not any((path / name).exists() for name in STORE_MARKS) and any(path.iterdir()):
            raise NotFound(f"{path} is no ckptd store (it holds files, but no jobs/ or "
                           "chunks/); check --url: a store is the directory `ckptd serve "
                           "--store` was given")
    return url


# What a store directory holds once anything was written (an empty one is a new store).
STORE_MARKS = ("jobs", "chunks", "gc", "cluster", ".locks")


def job_not_found(job: str, jobs: list[str], where: str) -> JobNotFound:
    """The error for a job the store does not hold, naming the jobs it does."""
    if not jobs:
        known = "it holds no jobs yet"
    elif len(jobs) <= JOBS_NAMED:
        known = "jobs there: " + ", ".join(sorted(jobs))
    else:
        known = f"it holds {len(jobs)} jobs (`ckptd ls` lists them)"
    return JobNotFound(f"no job {job!r} at {where}; {known}", job=job)


def check_listen(host: str, port: int) -> None:
    """``InvalidRequest`` when ``ckptd serve`` could not listen at ``host:port``: the
    port is taken, or the host is no address of this machine (uvicorn's own answer
    was nine lines of its log, the reason in the middle). Binds a socket as the
    server will (``SO_REUSEADDR``) and closes it again."""
    # (The family uvicorn binds with: IPv6 only for an address with a colon.)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequest(f"--host {host!r}: {exc.strerror}; give an address of this "
                             "machine (127.0.0.1, 0.0.0.0) or its name") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InvalidRequest(f"port {port} on {host}: address already in use "
                                     "(another ckptd serve?); stop it, or pass another "
                                     "--port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise InvalidRequest(f"--host {host}: not an address of this machine; give "
                                     "one of its addresses, or 0.0.0.0 for all") from None
            raise InvalidRequest(f"cannot listen on {host}:{port}: {exc.strerror}") from None
