"""``ckptd shm``: this host's staging pools (in ``/dev/shm``), and the removal of
those whose owner process is gone (docs/operations.md, "Shared memory")."""

from __future__ import annotations

import json
import os
import pwd
import re
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ckptd.cli import _human, app, console, err_console

if TYPE_CHECKING:
    from ckptd.client.staging.inventory import PoolInfo

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``6h`` or ``2d``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if m is None:
        raise typer.BadParameter(f"{text!r} is not an age: give seconds, or 30m, 6h, 2d",
                                 param_hint="--older-than")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _held(p: PoolInfo) -> str:
    if p.step is None:
        return "-" if p.state is None else f"({p.state})"
    return f"{p.step}" + ("" if p.restorable else f" ({p.state or 'torn'}, not whole)")


def _table(pools: list[PoolInfo]) -> Table:
    now = time.time()
    table = Table(box=None, pad_edge=False)
    for name in ("job", "rank", "size", "owner", "user", "step held", "changed", "directory"):
        table.add_column(name, justify="right" if name in ("rank", "size") else "left",
                         overflow="fold")
    for p in pools:
        owner = ("[green]alive[/]" if p.alive else "[red]dead[/]") + (
            f" (pid {p.pid})" if p.pid else "")
        table.add_row(escape(p.job), str(p.rank), _human(p.nbytes), owner, escape(_user(p.uid)),
                      _held(p), f"{_age(now - p.modified)} ago",
                      escape(str(p.directory)) + (f"  [dim]{escape(p.note)}[/]" if p.note else ""))
    return table


@app.command("shm")
def shm(
    clean: Annotated[bool, typer.Option(
        "--clean", help="Remove the pools whose owner process is gone (never a live one).")
    ] = False,
    job: Annotated[str | None, typer.Option("--job", help="Only this job's pools.")] = None,
    older_than: Annotated[str | None, typer.Option(
        "--older-than", metavar="AGE",
        help="With --clean: only pools unchanged for AGE (seconds, or 30m, 6h, 2d), so a "
             "worker that restarts soon still finds its snapshot.")] = None,
    mine: Annotated[bool, typer.Option(
        "--mine", help="Only this user's pools (default: every user's this one can read).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    shm_dir: Annotated[str | None, typer.Option(
        "--shm-dir", envvar="CKPTD_SHM_DIR",
        help="Where pools live (the clients' CKPTD_SHM_DIR).  [default: /dev/shm]")] = None,
) -> None:
    """List this host's staging pools (job, rank, size, owner alive or dead, step
    held); --clean removes the dead ones.

    A pool outlives a crashed worker on purpose: the restarted worker restores from
    it. Clean when no restart is coming (node boot, a job's epilog), or with
    --older-than."""
    from ckptd.client.staging.inventory import (
        list_pools,
        refused_user_roots,
        remove_dead_pools,
    )
    from ckptd.knobs import shm_dir as default_shm_dir

    age = None if older_than is None else parse_age(older_than)
    if age is not None and not clean:
        raise typer.BadParameter("--older-than only applies with --clean",
                                 param_hint="--older-than")
    root = default_shm_dir() if shm_dir is None else shm_dir
    if not os.path.isdir(root):
        err_console.print(f"[bold red]error[/] {escape(str(root))} is not a directory "
                          "(--shm-dir, CKPTD_SHM_DIR)", soft_wrap=True)
        raise typer.Exit(code=2)
    removed: list[PoolInfo] = []
    kept: list[PoolInfo] = []
    if clean:
        removed, kept = remove_dead_pools(root, job=job, older_than=age, all_users=not mine)
    pools, unreadable = list_pools(root, job=job, all_users=not mine)
    refused = refused_user_roots(root, all_users=not mine)
    if as_json:
        doc = {"root": str(root), "pools": [p.to_json() for p in pools],
               "unreadable": unreadable, "refused": refused}
        if clean:
            doc["removed"] = [p.to_json() for p in removed]
            doc["kept"] = [p.to_json() for p in kept]
        typer.echo(json.dumps(doc, indent=2))  # never wrapped, whatever the width
        return
    for p in removed:
        console.print(f"removed {escape(str(p.directory))} (job {escape(p.job)} rank {p.rank}, "
                      f"{_human(p.nbytes)}, step {p.step if p.step is not None else '-'})")
    for p in kept:
        console.print(f"[yellow]kept[/] {escape(str(p.directory))}: a process claimed it "
                      "meanwhile, or it is not this user's to remove")
    if pools:
        table = _table(pools)
        if console.is_terminal:
            console.print(table)
        else:  # off a terminal (a pipe, a log): whole rows, not squeezed into 80 columns
            from rich.console import Console

            Console(width=max(80, Console(width=10_000).measure(table).maximum)).print(table)
    elif not removed:
        which = (f" of job {job}" if job else "") + (" of this user" if mine else "")
        console.print(f"no staging pools{escape(which)} under {escape(str(root))}")
    for line in unreadable:
        err_console.print(f"[yellow]not readable[/] {escape(line)} (run as that user or root)",
                          soft_wrap=True)
    for line in refused:
        err_console.print(f"[yellow]warning[/] {escape(line)}: that user's ranks refuse to "
                          "stage there; remove it (someone else may have made it), or set "
                          "CKPTD_SHM_DIR", soft_wrap=True)
    if clean:
        dead = sum(1 for p in pools if not p.alive)
        live = len(pools) - dead
        console.print(f"{len(removed)} removed ({_human(sum(p.nbytes for p in removed))}); "
                      f"{live} live" + (f", {dead} dead kept (--older-than or --job)"
                                        if dead else ""))
