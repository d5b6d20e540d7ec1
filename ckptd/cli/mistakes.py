"""A person's mistakes on the command line: one or two lines that say what was
wrong and what is allowed, exit code 2, never a traceback."""

from __future__ import annotations

import errno
import os
import re
import socket
import ssl
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from ckptd.errors import (
    CkptdError,
    InvalidName,
    InvalidRequest,
    NotFound,
    StoreError,
)

try:  # typer carries its own copy of click since 0.2x; the errors are that copy's
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on click itself
    from click import exceptions as click_errors  # type: ignore[no-redef]

if TYPE_CHECKING:
    from ckptd.server.settings import Settings
    from ckptd.store import Store

# The exit code of every usage mistake (click's, and ckptd's own `_fail`).
USAGE = 2


# Options of ``ckptd`` itself, which go before the command.
_APP_OPTIONS = ("-v", "--verbose", "--version")


def _usage_hint(exc: click_errors.UsageError, where: str) -> str:
    """The line under a usage mistake: where the help is, or, for an option of
    ``ckptd`` itself given after a command (``ckptd ls -v``), where it goes."""
    name = getattr(exc, "option_name", None)
    names, ctx = [], exc.ctx
    while ctx is not None and ctx.parent is not None:  # (the root's name is the program's)
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    command = " ".join(reversed(names))
    if isinstance(exc, click_errors.NoSuchOption) and name in _APP_OPTIONS and command:
        if name == "--version":
            return "--version is ckptd's own option: `ckptd --version`"
        return f"{name} is ckptd's own option and goes before the command: `ckptd {name} " \
               f"{command} ...`"
    return f"see `{where} --help`"


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
        err_console.print(escape(_usage_hint(exc, where)), highlight=False)
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


# What to give, said after a refused value of these settings (the refusal names what
# is wrong with it).
SETTING_USE = {
    "peers": "give every replica's URL, comma-separated (http://a:8470,http://b:8470)",
    "advertise_url": "give the URL clients reach this replica at (http://host:port)",
}


def name_settings(message: str, given: Collection[str]) -> str:
    """A rule over several settings (its message names their fields, ``tls_cert``)
    in the user's words: options when one of them was ``given`` as one, else the
    variables that set them."""
    from ckptd.server.settings import Settings

    message = message.removeprefix("Value error, ")
    named = {w for w in re.findall(r"\w+", message) if w in Settings.model_fields}
    options = bool(named & set(given))
    return re.sub(r"\w+", lambda m: m[0] if m[0] not in named else (
        f"--{m[0].replace('_', '-')}" if options else f"CKPTD_{m[0].upper()}"), message)


# Settings whose value a refusal must not repeat (a log, a terminal, a CI's output).
_SECRETS = frozenset({"token", "peer_secret"})


def server_settings(overrides: dict[str, Any]) -> Settings:
    """``ckptd serve``'s settings (options over ``CKPTD_*``), checked before the
    server starts: a bad value is one line, not a traceback from inside uvicorn."""
    import pydantic

    from ckptd.server.settings import Settings

    try:
        settings = Settings(**overrides)
    except pydantic.ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "?"
            option = f"--{name.replace('_', '-')}"
            source = option if name in overrides else f"CKPTD_{name.upper()}"
            if not error["loc"]:  # a rule over several settings: its message names them
                problems.append(name_settings(error["msg"], overrides))
                continue
            use = f"; {SETTING_USE[name]}" if name in SETTING_USE else ""
            given = error.get("input")
            said = name in _SECRETS or str(given) in error["msg"]  # (a message naming it)
            got = "" if said else f" (got {given!r})"
            problems.append(f"{source}: {error['msg'].removeprefix('Value error, ')}"
                            f"{got}{use}")
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
    _check_server_knobs()
    if settings.single_writer and (settings.peers or settings.member_leases):
        raise InvalidRequest("--single-writer: this server must be the store's only writer, "
                             "so it cannot run with --peers or --member-leases")
    return settings


def _check_server_knobs() -> None:
    """The ``CKPTD_*`` variables the server reads where it uses them (clients read
    them too, so they are no ``Settings``), read once before it starts: a bad one
    passed ``serve --check`` and then failed every save with a 400 that named the
    variable as if the rank had set it (found by a probe of the docs)."""
    from ckptd import knobs

    for read in (knobs.max_manifest_bytes, knobs.claim_lease, knobs.missing_batch,
                 knobs.malloc_mmap_threshold, knobs.direct_writes, knobs.connect_timeout,
                 knobs.request_timeout, knobs.retries, knobs.retry_backoff):
        read()  # (``InvalidRequest`` naming the variable and what to set)


def checked_serve(overrides: dict[str, Any], check: bool) -> tuple[Settings, Store | str]:
    """``ckptd serve``'s settings and store, each checked (a mistake: ``CkptdError``;
    a store that ignores conditions is refused); with ``check``, what the check says
    in place of the store."""
    settings = server_settings(overrides)
    check_listen(settings.host, settings.port)
    if check:
        _say_start_warnings(settings)
    if check and (new := new_local_store(settings)) is not None:
        return settings, new
    store = writable_store(settings, server_store(settings), check=check)
    return settings, f"ok: would serve {store.describe()}" if check else store


def _say_start_warnings(settings: Settings) -> None:
    """What ``ckptd serve`` would warn of as it starts (``ckptd.server.app``'s own
    words): ``serve --check --host 0.0.0.0`` with no token said only ok."""
    from ckptd.cli import err_console
    from ckptd.server.app import start_warnings

    for line in start_warnings(settings):
        err_console.print(f"[yellow]warning[/] {escape(line)}", soft_wrap=True, highlight=False)


def server_store(settings: Settings) -> Store:
    """``ckptd serve``'s store, opened (a local one is made where it is not yet)
    once the settings and the port were found good: a refused start leaves nothing
    behind."""
    from ckptd.store import open_store

    text = settings.store
    local = _local_path(text)
    if local is not None and local.exists() and not local.is_dir():
        raise InvalidRequest(f"the store {text} is a file, not a directory: give --store "
                             "(CKPTD_STORE) a directory, a new one or a ckptd store")
    store = open_store(text)
    from ckptd.store.local import LocalStore

    if isinstance(store, LocalStore):
        _warn_small_disk(settings, store.root)
    return store


def _local_path(store: str) -> Path | None:
    """The directory of a local store (a path or a ``file://`` URL); None for others."""
    from urllib.parse import urlparse

    if store.startswith("file://"):
        return Path(urlparse(store).path)
    return None if "://" in store else Path(store)


def new_local_store(settings: Settings) -> str | None:
    """What ``serve --check`` says of a local store that is not there yet, which the
    check does not make (a mistyped path is left as it was); None when the store is
    there or not local. ``StoreError`` when the store could not be made there."""
    store = settings.store
    local = _local_path(store)
    if local is None or local.exists():
        return None
    above = local.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    try:  # (what serve would do there first; root passes every access() check)
        os.rmdir(tempfile.mkdtemp(prefix=".ckptd-check-", dir=above))
    except OSError as exc:
        why = " is not a directory" if not above.is_dir() else f": {exc.strerror or exc}"
        raise StoreError(f"cannot create store directory {local}: {above}{why}",
                         store=store) from None
    _warn_small_disk(settings, local)
    return f"ok: would serve file://{local} (not there yet: serve makes it; the check made nothing)"


def _warn_small_disk(settings: Settings, root: Path) -> None:
    """Says at start when a local store's file system has less free space than the
    server keeps free: every save would be refused (store_full), even on an empty
    store, and forgetting steps would not help."""
    import shutil

    from ckptd.knobs import human_bytes

    if not settings.min_free_bytes:
        return
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < settings.min_free_bytes:
        from ckptd.cli import err_console

        err_console.print(
            f"[yellow]warning[/] the store's file system has {human_bytes(free)} free, under "
            f"the {human_bytes(settings.min_free_bytes)} this server keeps free "
            "(CKPTD_MIN_FREE_BYTES): every save will be refused until it has more, or "
            "that setting is lowered", soft_wrap=True, highlight=False)


def _check_server_files(settings: Settings) -> None:
    """The retention file, the peers and the tokens file, read as the server will read
    them: a mistake there is one line now, not a traceback from uvicorn's lifespan."""
    from ckptd.cluster import parse_urls
    from ckptd.lifecycle.retention import load_retention

    if settings.retention is not None:
        load_retention(settings.retention)
    tokens = None if settings.tokens_file is None else Path(settings.tokens_file)
    if tokens is not None and tokens.is_dir():
        raise InvalidRequest(f"--tokens-file {tokens} is a directory: give the path of a "
                             f"tokens file (e.g. {tokens / 'tokens.json'}), written by `ckptd "
                             "token create --job JOB --role ROLE --file FILE`")
    if tokens is not None and tokens.is_file():
        from ckptd.tokens import TokenFile

        try:  # (read as the server reads it: --check said ok for a file serve refused)
            TokenFile(tokens)
        except CkptdError as exc:  # (its message names the file and the entry)
            said = exc.message if str(tokens) in exc.message else f"{tokens}: {exc.message}"
            raise InvalidRequest(f"--tokens-file {said}") from None
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


def writable_store(settings: Settings, store: Store, check: bool = False) -> Store:
    """``store`` if it writes conditionally (``ckptd.store.probe``); else, for a
    single writer (``--single-writer``), wrapped so that this process checks the
    conditions; else ``StoreError`` naming the store and what it lacks. ``check``
    (``serve --check``): a store id that does not read is said too (the server
    only logs it as it starts)."""
    import asyncio

    from ckptd.store.probe import conditional_write_gaps
    from ckptd.store.single_writer import SingleWriterStore

    async def probe() -> list[str]:
        try:
            if check:
                _say_store_id_trouble(await _store_id_trouble(store))
                _say_gc_trouble(await _gc_trouble(store))
                if settings.peers:
                    _say_peer_stores(store, *await _peer_stores(settings, store))
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
    from ckptd.cli import err_console

    err_console.print(f"[yellow]warning[/] store {escape(store.describe())} cannot write "
                      f"conditionally ({escape(lacks)}); serving it as its single writer: "
                      "no other server or client may write to it", soft_wrap=True)
    return SingleWriterStore(store)


async def _store_id_trouble(store: Store) -> str | None:
    """Why the store's id (``cluster/store-id``) does not read, or None (read, or not
    written yet: the first server writes it)."""
    from ckptd.cluster import STORE_ID_KEY, StoreIdentity
    from ckptd.errors import InvalidDocument, NotFound, StoreCorrupt, UnsupportedStoredFormat

    try:
        StoreIdentity.parse(await store.get(STORE_ID_KEY))
    except NotFound:
        return None
    except (StoreCorrupt, InvalidDocument, UnsupportedStoredFormat) as exc:
        return exc.message
    except CkptdError:
        # A store that does not answer (no bucket, no credentials, no endpoint): its
        # own error comes next; the advice to remove the id fit none of those.
        return None
    return None


def _say_store_id_trouble(trouble: str | None) -> None:
    if trouble is None:
        return
    from ckptd.cli import err_console

    err_console.print(
        f"[yellow]warning[/] {escape(trouble)}: a server serves the store all the same, but "
        "clients cannot check that the replicas they are given serve one store. If no "
        "server serves it now, remove cluster/store-id and the next `ckptd serve` writes "
        "a new one (docs/FORMAT.md)", soft_wrap=True)


async def _peer_stores(settings: Settings, store: Store) -> tuple[str | None, dict[str, str]]:
    """The store's id (None: none yet) and the ids of the ``--peers`` that answer
    (2 s each, all at once; a peer that is down is passed over)."""
    from ckptd.cluster import STORE_ID_KEY, StoreIdentity, normalize_url, parse_urls
    from ckptd.errors import NotFound
    from ckptd.server.cluster_peers import peer_store_ids

    try:
        mine: str | None = StoreIdentity.parse(await store.get(STORE_ID_KEY)).id
    except NotFound:
        mine = None
    except CkptdError:
        return None, {}  # (said above, or by the store's own error next)
    own = normalize_url(settings.advertise_url or f"http://{settings.host}:{settings.port}")
    peers = [p for p in parse_urls(settings.peers or "") if p != own]
    theirs = await peer_store_ids(peers, settings.token)
    return mine, {p: sid for p, sid in theirs.items() if sid != mine}


def _say_peer_stores(store: Store, mine: str | None, other: dict[str, str]) -> None:
    """A warning for each peer that serves another store than ``store``."""
    from ckptd.cli import err_console

    has = f"has store id {mine[:8]}" if mine else "has no store id yet (a new store)"
    for peer, sid in other.items():
        err_console.print(
            f"[yellow]warning[/] peer {escape(peer)} in --peers serves another store (store "
            f"id {sid[:8]}) than this one: {escape(store.describe())} {has}. Clients leave "
            "a replica on another store out of their routing: check --store "
            "(docs/replicas.md)", soft_wrap=True)


async def _gc_trouble(store: Store) -> str | None:
    """What a damaged GC state (``gc/state``) means, or None (readable, or none)."""
    from ckptd.errors import CkptdError
    from ckptd.lifecycle.gc import gc_state

    try:
        state = await gc_state(store)
    except CkptdError:
        return None  # (a newer ckptd's state: the server says so where it is read)
    return str(state["note"]) if state.get("phase") == "damaged" else None


def _say_gc_trouble(trouble: str | None) -> None:
    if trouble is None:
        return
    from ckptd.cli import err_console

    err_console.print(f"[yellow]warning[/] {escape(trouble)}", soft_wrap=True)


# A server's host:port written without its scheme (localhost:8470, 10.0.0.5:8470,
# [::1]:8470): taken for a store's relative path, it named a store that is not there.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):[0-9]{1,5}")


def server_url(url: str) -> str:
    """``url`` when it names servers as ``http(s)://host:port`` (several, comma-
    separated): ``InvalidRequest`` in a line for a path or a query after the port
    (the API's paths were added to it: "no route for POST /v1/v1/..."), and for a
    host:port without its scheme, naming the URL meant."""
    from ckptd.client.endpoint import check_url, is_host_port

    if not url.startswith(("http://", "https://")):
        if is_host_port(url):
            raise InvalidRequest(f"--url {url!r} has no scheme: did you mean http://{url}?")
        raise InvalidRequest(f"this command needs a server (http://host:port), not {url!r}")
    checked: str = check_url(url, "--url")  # (the checkpointer's and Lightning's check)
    return checked


def store_url(url: str) -> str:
    """``url`` as every command takes it: a server's (checked by ``server_url``), a
    store's URL unchanged, or a bare path: the ``file://`` URL of that directory
    (``ckptd gc --url DIR`` took one, ``ckptd ls --url DIR`` refused it)."""
    if url.startswith(("http://", "https://")):
        return server_url(url)
    if "://" in url:
        return url
    if not url:
        raise InvalidRequest("--url is empty: give http://host:port of a server, or a store "
                             "(a directory, file:///path or s3://bucket/prefix)")
    path = Path(url)
    if _HOST_PORT.fullmatch(url) and not path.exists():
        raise InvalidRequest(f"no store at {path.absolute()}: did you mean http://{url}? "
                             "(--url takes a server as http://host:port)")
    return f"file://{path.absolute()}"


def existing_store(url: str) -> str:
    """``url`` (a bare path as its ``file://`` URL, see ``store_url``) when it is not a
    local path, or names a store directory that exists: a reading command never
    creates a store where none was."""
    from ckptd.cluster import parse_url

    url = store_url(url)
    parsed = parse_url(url)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise InvalidRequest(f"file URL {url!r} names a host ({parsed.netloc}); a store "
                             "directory is file:///absolute/path (three slashes)")
    if parsed.scheme == "file" and parsed.path:
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


def check_reason(reason: str) -> str:
    """``reason`` if a server takes it as a rollback's reason (``ckptd.api``): a
    store used directly took any length, a server refused it naming ``body.reason``."""
    from annotated_types import MaxLen

    from ckptd.api import RollbackRequest

    limit = next(m.max_length for m in RollbackRequest.model_fields["reason"].metadata
                 if isinstance(m, MaxLen))
    if len(reason) > limit:
        raise InvalidRequest(f"--reason is {len(reason)} characters long: give at most {limit}")
    return reason


def restore_target(to: str) -> None:
    """``InvalidRequest`` when ``ckptd restore --to`` (a path or ``file:///path``) is,
    or lies under, a file: the store's own answer was "[store_error] cannot create
    store directory ...: [Errno 17] File exists"."""
    from urllib.parse import urlparse

    path = Path(urlparse(to).path if to.startswith("file://") else to)
    for here in (path, *path.parents):
        if here.exists():
            if not here.is_dir():
                what = "is a file" if here == path else f"lies under {here}, a file"
                raise InvalidRequest(f"--to {to} {what}: give a directory to fill (a new "
                                     "one, or one a restore filled before)")
            return


def rank_of_restore(exc: CkptdError) -> CkptdError:
    """``exc``, or, where it refuses the rank for the step's world size, the same said
    of ``--rank`` (it said "check rank= and world_size=", the API's arguments)."""
    rank, world_size = exc.detail.get("rank"), exc.detail.get("world_size")
    if not isinstance(exc, InvalidName) or not isinstance(rank, int) \
            or not isinstance(world_size, int):
        return exc
    job = exc.detail.get("job")
    return InvalidName(f"--rank {rank}: " + (f"job {job!r} has" if job else "the step has")
                       + f" a world size of {world_size}, so --rank is 0 to {world_size - 1}",
                       **exc.detail)


def unknown_job(exc: CkptdError, url: str, token: str | None, job: str) -> CkptdError:
    """``exc``, or, when it says ``job`` has no committed checkpoint and the store
    holds no step of ``job`` at all, the error naming the jobs there (as ``ls`` and
    ``verify`` do; through a server, those its token may see). ``exc`` as it is when
    that cannot be asked."""
    import asyncio

    from ckptd.errors import CheckpointNotFound

    if not isinstance(exc, CheckpointNotFound):
        return exc

    async def ask() -> CkptdError:
        from ckptd.client.transport import missing_job, open_transport

        transport = open_transport(url, token=token, create=False)
        try:
            return await missing_job(transport, job) or exc
        finally:
            await transport.close()

    try:
        return asyncio.run(ask())
    except (CkptdError, OSError, KeyboardInterrupt):  # (Ctrl-C: the error as it was)
        return exc


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
