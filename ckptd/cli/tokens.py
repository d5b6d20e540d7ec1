"""``ckptd token``: create, list and revoke scoped tokens in a tokens file."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ckptd.cli import _fail, _when, app, console, err_console
from ckptd.cli.text import visible
from ckptd.errors import CkptdError

token_app = typer.Typer(
    help="Scoped tokens: a role on the jobs a pattern matches (docs/SECURITY.md).",
    no_args_is_help=True,
)
app.add_typer(token_app, name="token")

FileOpt = Annotated[
    str,
    typer.Option(
        "--file",
        envvar="CKPTD_TOKENS_FILE",
        help="The tokens file the server reads (ckptd serve --tokens-file).",
    ),
]
DEFAULT_FILE = "./ckptd-tokens.json"


@token_app.command("create")
def token_create(
    job: Annotated[str, typer.Option("--job", help="A job name, a prefix like 'llm-*', or '*'.")],
    role: Annotated[
        str, typer.Option("--role", help="read (restores, dashboards, ls, status), write "
                          "(training ranks: saves, commits, heartbeats, rollback, tags), admin "
                          "(verify, retention, removing a tag; on '*': gc and scrub). Each "
                          "role holds the ones before it (docs/SECURITY.md).")
    ],
    note: Annotated[str, typer.Option(help="Who or what it is for.")] = "",
    file: FileOpt = DEFAULT_FILE,
) -> None:
    """Create a token; it is printed once, and only its hash is kept (a file whose
    directory is not there is made in a new one, and that is said)."""
    from pathlib import Path

    from ckptd.tokens import create_token

    # The highest directory of --file not there yet (the file's directories are made:
    # `serve --tokens-file` advises this command for a file not there): said, not
    # made silently, so that a mistyped directory is seen (found by a probe).
    made = next((p for p in reversed(Path(file).parents) if not p.exists()), None)
    try:
        token, entry = create_token(file, job, role, note)
    except CkptdError as exc:
        _fail(exc)
        return
    except OSError as exc:
        console.print(f"[bold red]error[/] cannot write {escape(file)}: {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    console.print(token, markup=False, highlight=False, soft_wrap=True)
    if made is not None:
        typer.echo(f"made directory {made} for {file} (it was not there)", err=True)
    typer.echo(f"token {entry.id}: {entry.role} on {entry.job!r}, kept hashed in {file}; "
               "it is not shown again", err=True)


@token_app.command("list")
def token_list(file: FileOpt = DEFAULT_FILE) -> None:
    """List the tokens of a file (ids, scopes; never the tokens)."""
    from pathlib import Path

    from ckptd.errors import NotFound
    from ckptd.tokens import list_tokens

    if not Path(file).is_file():  # an empty table would say the file has no tokens
        _fail(NotFound(f"no tokens file {file}: pass --file (or CKPTD_TOKENS_FILE), or create "
                       "one with ckptd token create"))
    try:
        entries = list_tokens(file)
    except CkptdError as exc:
        _fail(exc)
        return
    table = Table("id", "job", "role", "created (UTC)", "note")
    for e in entries:
        table.add_row(e.id, escape(e.job), e.role, _when(e.created_at), escape(e.note))
    console.print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (ckptd token list).")],
    file: FileOpt = DEFAULT_FILE,
) -> None:
    """Remove a token; a running server stops accepting it within a second."""
    from pathlib import Path

    from ckptd.tokens import revoke_token

    if not Path(file).is_file():  # (it said "no token X in FILE", as if FILE were read)
        err_console.print(f"[bold red]error[/] no tokens file {escape(file)}: pass the file "
                          "the server reads with --file (ckptd serve --tokens-file)",
                          soft_wrap=True)
        raise typer.Exit(code=2)
    try:
        found = revoke_token(file, token_id)
    except CkptdError as exc:
        _fail(exc)
        return
    if not found:  # (a mistyped id: a user's mistake, as every other is, exit 2)
        err_console.print(f"[bold red]error[/] no token {escape(visible(token_id))} in "
                          f"{escape(file)}: `ckptd token list --file {escape(file)}` lists "
                          "their ids", soft_wrap=True)
        raise typer.Exit(code=2)
    console.print(f"token {escape(token_id)} revoked")
