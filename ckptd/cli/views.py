"""Views of committed steps: ``ckptd export --zarr`` / ``--safetensors``, ``ckptd import``,
``ckptd diff``.

The flows live in the client (``ckptd.client.zarr_export``, ``step_import``,
``step_diff``), imported inside each command so ``import ckptd.cli`` stays light.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, NoReturn

import typer
from rich.markup import escape
from rich.table import Table

from ckptd.cli import (
    DEFAULT_URL,
    TokenOpt,
    UrlOpt,
    _fail,
    _human,
    app,
    console,
    err_console,
    step_number,
    step_or_latest,
    transfer_bar,
)
from ckptd.cli.mistakes import unknown_job
from ckptd.cli.text import visible
from ckptd.errors import CkptdError, InvalidRequest, NotFound
from ckptd.format import check_job


def _existing(url: str, token: str | None) -> str:
    """``url``, unless it is a ``file://`` path that holds no store, or servers that
    do not answer as they should: then the lines ``ckptd ls`` says, exit 2 (reading
    never creates a store)."""
    from ckptd.cli.mistakes import existing_store
    from ckptd.cli.servers import check_servers

    try:
        return check_servers(existing_store(url), token)
    except CkptdError as exc:
        _fail(exc)
        raise  # (_fail exits)


def _zarr_missing() -> None:
    _fail(InvalidRequest("this needs zarr: pip install 'ckptd[zarr]'"))


@app.command("export")
def export(
    job: Annotated[str, typer.Argument(help="Job to export.")],
    step: Annotated[int | None, typer.Argument(
        parser=step_or_latest, metavar="STEP",
        help="Committed step, or latest (default: latest).")] = None,
    zarr_dir: Annotated[
        str, typer.Option("--zarr",
                          help="A new or empty directory to write a zarr v3 hierarchy to.")
    ] = "",
    codec: Annotated[
        str | None, typer.Option(help="Compress chunks: zstd, gzip or blosc (default: none).")
    ] = None,
    safetensors_dir: Annotated[
        str, typer.Option("--safetensors",
                          help="A new or empty directory to write Hugging Face safetensors "
                          "files to.")
    ] = "",
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size",
                          help="Largest safetensors file: 5GB (10^9), 2GiB (2^30) or bytes.")
    ] = "5GB",
    only: Annotated[
        list[str] | None, typer.Option(
            "--only", help="Export only tensors whose names start with this (repeatable).")
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option(
            "--exclude", help="Leave out tensors whose names start with this (repeatable).")
    ] = None,
    strip: Annotated[
        str, typer.Option("--strip", help="Remove this prefix from the exported names.")
    ] = "",
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Write a committed step as a plain zarr v3 hierarchy any zarr reader opens, or as
    Hugging Face safetensors files with their index (--safetensors)."""
    if zarr_dir and safetensors_dir:
        _fail(InvalidRequest("export to one place at a time: --zarr DIR or --safetensors DIR"))
    url = _existing(url, token)
    if safetensors_dir:
        if codec is not None:
            _fail(InvalidRequest("--codec is for --zarr; safetensors files are not compressed"))
        _export_safetensors(job, step, safetensors_dir, max_shard_size, only or [],
                            exclude or [], strip, url, token)
        return
    if only or exclude or strip or max_shard_size != "5GB":
        _fail(InvalidRequest("--only, --exclude, --strip and --max-shard-size are for "
                             "--safetensors DIR"))
    if not zarr_dir:
        _fail(InvalidRequest("say where to: ckptd export JOB [STEP] --zarr DIR "
                             "(or --safetensors DIR)"))
    try:
        from ckptd.client.zarr_export import export_step
    except ImportError:
        _zarr_missing()
        return
    try:
        with console.status(f"exporting {job}"):
            result = export_step(url, job, zarr_dir, step, token=token, codec=codec)
    except CkptdError as exc:
        _fail(unknown_job(exc, url, token, job))
        return
    except KeyboardInterrupt:
        _interrupted(zarr_dir)
    rate = result.nbytes / result.seconds / 2**30 if result.seconds else 0.0
    console.print(
        f"[green]ok[/]: step {result.step} of {job}: {_n(result.arrays, 'array')}, "
        f"{_n(result.chunks, 'chunk')}, {_human(result.nbytes)} in {result.seconds:.1f}s "
        f"({rate:.2f} GiB/s) into {result.directory}"
    )


def _interrupted(where: str) -> NoReturn:
    """Ctrl-C of an export: what it wrote is gone (it writes beside DIR and renames
    only a complete export onto it), said in a line; exit 130, as the shell has it."""
    err_console.print(f"interrupted: the export into {escape(where)} did not finish and "
                      "left nothing there; run the same command again", soft_wrap=True)
    raise typer.Exit(code=130) from None


def _export_safetensors(job: str, step: int | None, directory: str, max_shard_size: str,
                        only: list[str], exclude: list[str], strip: str, url: str,
                        token: str | None) -> None:
    from ckptd.client.integrations.safetensors.layout import parse_size

    try:  # (before torch is imported: ~1.5 s of the command)
        limit = parse_size(max_shard_size, "--max-shard-size")
        check_job(job)
    except CkptdError as exc:
        _fail(exc)
        return
    from ckptd.client.integrations.safetensors import export_safetensors

    bar = transfer_bar()
    task = bar.add_task(f"exporting {job}", total=None)

    def on_bytes(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    try:
        with bar:
            result = export_safetensors(url, job, directory, step, token=token,
                                        max_shard_size=limit, only=only,
                                        exclude=exclude, strip=strip, on_bytes=on_bytes)
    except CkptdError as exc:
        _fail(unknown_job(exc, url, token, job))
        return
    except KeyboardInterrupt:
        _interrupted(directory)
    rate = result.nbytes / result.seconds / 2**30 if result.seconds else 0.0
    skipped = (f"; left out {_n(len(result.skipped_local), 'rank-local tensor')}"
               if result.skipped_local else "")
    console.print(
        f"[green]ok[/]: step {result.step} of {job}: {_n(result.tensors, 'tensor')}, "
        f"{_human(result.nbytes)} in {_n(len(result.files), 'safetensors file')}, every chunk "
        f"verified, in {result.seconds:.1f}s ({rate:.2f} GiB/s) into {result.directory}"
        f"{skipped}"
    )


@app.command("import")
def import_(
    source: Annotated[
        str, typer.Argument(help="A zarr v3 directory, a dcp.save directory, a torch.save "
                            "file, or safetensors (a file, or a directory with its index).")
    ],
    job: Annotated[str, typer.Option("--job", help="Job to import into.")],
    step: Annotated[int, typer.Option("--step", parser=step_number, metavar="STEP",
                                      help="Step number to commit it as.")],
    exclude: Annotated[
        list[str] | None, typer.Option(
            "--exclude", help="Leave out tensors whose names start with this (repeatable).")
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Bring an existing checkpoint into the store as a committed, verified step."""
    from ckptd.cli.mistakes import store_url
    from ckptd.cli.servers import check_servers

    # The mistakes first, said before torch is imported (~1.5 s of the command).
    try:
        check_job(job)
        if not os.path.exists(source):
            raise NotFound(f"{source} does not exist")
        # (a bare path is a store: writing, this command may create one there)
        url = check_servers(store_url(url), token)
    except CkptdError as exc:
        _fail(exc)
        return
    try:
        from ckptd.client.step_import import import_checkpoint
    except ImportError:
        _zarr_missing()
        return
    # A failed save is this command's error, said once below: not also the log line
    # (and the advice to training) the checkpointer gives a save nobody waits on.
    # (Put back after: the command may run in a process that goes on, a CliRunner.)
    quiet = logging.getLogger("ckptd.client.checkpointer")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with console.status(f"importing {source}"):
            result = import_checkpoint(source, url, job, step, token=token,
                                       exclude=exclude or [])
    except CkptdError as exc:
        _fail(exc)
        return
    finally:
        quiet.setLevel(level)
    console.print(
        f"[green]ok[/]: {result.kind} checkpoint {source} is step {result.step} of {job}: "
        f"{_n(result.tensors, 'tensor')}, {_human(result.nbytes)}, committed and read back "
        f"bitwise in {result.seconds:.1f}s"
    )


def _n(count: int, thing: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{count} {thing}{'' if count == 1 else 's'}"


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


@app.command("diff")
def diff(
    job: Annotated[str, typer.Argument(help="Job.")],
    step_a: Annotated[int, typer.Argument(parser=step_number, metavar="STEP_A",
                                          help="The older step.")],
    step_b: Annotated[int, typer.Argument(parser=step_number, metavar="STEP_B",
                                          help="The newer step.")],
    values: Annotated[
        bool, typer.Option("--values", help="Read changed chunks for max-abs/relative diffs.")
    ] = False,
    show_all: Annotated[bool, typer.Option("--all", help="List unchanged tensors too.")] = False,
    exit_code: Annotated[bool, typer.Option(
        "--exit-code", help="Exit 1 when a tensor differs, 0 when none does (as "
        "git diff --exit-code).")] = False,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """List the tensors that changed between two steps and the chunks each shares."""
    try:
        from ckptd.client.step_diff import diff_steps
    except ImportError:
        _zarr_missing()
        return
    url = _existing(url, token)
    try:
        diffs = diff_steps(url, job, step_a, step_b, token=token, values=values)
    except CkptdError as exc:
        _fail(exc)
        return
    columns = ["tensor", "change", "shared chunks"]
    if values:
        columns += ["max abs diff", "max rel diff"]
    table = Table(*columns)
    for d in diffs:
        if d.status == "same" and not show_all:
            continue
        # (a tenant named the tensor: its control characters written out, its
        # brackets text, not rich markup)
        row = [escape(visible(d.path)), d.status, f"{d.shared_chunks}/{d.chunks}"]
        if values:
            row += [_number(d.max_abs), _number(d.max_rel)]
        table.add_row(*row)
    console.print(table)
    changed = sum(1 for d in diffs if d.status != "same")
    console.print(f"{changed} of {len(diffs)} tensors differ between step {step_a} and {step_b}")
    if exit_code and changed:
        raise typer.Exit(1)
