"""``ckptd status``: live rank health in a table per job, once or ``--watch``ed."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ckptd.cli import (
    DEFAULT_URL,
    ServerUrlOpt,
    TokenOpt,
    _fail,
    _server,
    _when,
    app,
    console,
)
from ckptd.cli.text import visible
from ckptd.errors import CkptdError, JobNotFound
from ckptd.format import check_job

_STATE_STYLE = {
    "alive": "green",
    "degraded": "yellow",
    "critical": "bold dark_orange",
    "dead": "bold red",
    "left": "dim",
}
# Probe signals shown in columns (docs/API.md), one reading per instance as
# name[instance]: the hottest GPU, the sum of uncorrected ECC errors, host memory.
_TEMP = (("gpu_temperature_c", "gpu_temp_c"), max)
_ECC = (("gpu_ecc_uncorrected_volatile", "gpu_ecc_errors"), sum)
_MEM = (("host_memory_percent", "host_mem_pct"), max)


def _signal(health: dict[str, Any], which: tuple[tuple[str, ...], Any]) -> Any:
    names, combine = which
    numbers: list[float] = []
    other = None
    for key, value in (health.get("signals") or {}).items():
        if key.split("[", 1)[0] not in names or value is None:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers.append(value)
        elif other is None:
            other = value  # "unavailable", "nan": shown when there is no number
    return combine(numbers) if numbers else other


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def _number(value: Any, fmt: str, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:{fmt}}{unit}"
    return str(value)


_COLUMNS = ("rank", "state", "step", "held", "last beat", "GPU temp", "ECC", "host mem", "rtt")
# Narrow terminals: shorter names; signal columns without a reading are dropped,
# and the reasons go under the table (wrapped, never cut).
_COMPACT = dict(zip(_COLUMNS, ("rank", "state", "step", "held", "beat", "GPU", "ECC", "mem",
                               "rtt"), strict=True))


def status_view(overview: dict[str, Any], width: int | None = None) -> Any:
    """Rich renderables of ``GET /v1/overview``: per job a table of its ranks, fit
    to ``width`` columns when given."""
    from rich.console import Console, Group

    parts: list[Any] = []
    for job in overview["jobs"]:
        table, notes = _job_table(job, compact=False)
        if width is not None and Console(width=10_000).measure(table).maximum > width:
            table, notes = _job_table(job, compact=True)
        parts.append(table)
        parts.extend(notes)
    if not parts:
        from rich.text import Text

        parts.append(Text("no jobs", style="dim"))
    return Group(*parts)


def _job_table(job: dict[str, Any], *, compact: bool) -> tuple[Any, list[Any]]:
    """One job's table of ranks, and the lines under it."""
    from rich import box
    from rich.text import Text

    parts: list[Any] = []
    latest = job["latest"] if job["latest"] is not None else "none"
    # A latest ref this ckptd cannot read is not "none": a restart would not start over.
    unreadable = job.get("unsupported") or job.get("damaged")
    if job.get("unsupported"):
        latest = "[bold red]unsupported (a newer ckptd wrote it: upgrade ckptd)[/]"
    elif job.get("damaged"):
        latest = "[bold red]damaged[/]"
    if unreadable:
        parts.append(Text(f"  latest: {visible(str(unreadable))}", style="red"))  # (no markup)
    title = f"[bold]{job['job']}[/]  world {job['world_size'] or '?'}  last committed {latest}"
    if job["snapshot_at"] is not None:
        reason = escape(visible(str(job["snapshot_reason"])))  # a client's words, not markup
        title += f"  [blue]snapshot at {job['snapshot_at']} ({reason})[/]"
    if job["rollback_to"] is not None:
        title += f"  [bold red]rollback to {job['rollback_to']}[/]"
    damaged = job.get("damaged_steps") or []
    if damaged:
        title += f"  [bold red]damaged steps {damaged} (scrub; latest skips them)[/]"
    table = Table(title=title, title_justify="left", expand=False)
    if compact:
        table.box, table.show_edge, table.pad_edge = box.SIMPLE_HEAD, False, False
    rows: list[list[Any]] = []
    notes: list[Any] = []
    for r in job["ranks"]:
        health = r.get("health") or {}
        temp = _signal(health, _TEMP)
        ecc = _signal(health, _ECC)
        reasons = visible("; ".join(health.get("reasons") or []))  # a rank's words
        if r["state"] == "dead" and not reasons:
            reasons = "no heartbeat"
        style = _STATE_STYLE.get(r["state"], "")
        if compact and reasons:
            notes.append(Text(f"  rank {r['rank']}: {reasons}"))  # as sent: no markup
        rows.append([
            str(r["rank"]),
            f"[{style}]{r['state']}[/]",
            _number(r["step"], "d"),
            _number(r["held_step"], "d"),
            _age(r["age_s"]),
            ("[yellow]" if isinstance(temp, int | float) and temp >= 85 else "[default]")
            + _number(temp, ".0f", " °C") + "[/]",
            ("[red]" if isinstance(ecc, int | float) and ecc > 0 else "[default]")
            + _number(ecc, "g") + "[/]",
            _number(_signal(health, _MEM), ".0f", " %"),
            _number(r["rtt_ms"], ".1f", " ms"),
            Text(reasons),  # as sent: no markup
        ])
    shown = [
        i for i, name in enumerate(_COLUMNS)
        if not compact or i < 5 or any("-[/]" not in row[i] and row[i] != "-" for row in rows)
    ]
    for i in shown:
        name = _COLUMNS[i]
        table.add_column(_COMPACT[name] if compact else name, no_wrap=True,
                         justify="left" if name == "state" else "right")
    if not compact:
        table.add_column("reasons", overflow="fold", min_width=12)
    for row in rows:
        table.add_row(*[row[i] for i in shown], *([] if compact else [row[-1]]))
    if not job["ranks"]:
        table.caption = "no heartbeats from this job's ranks"
    parts.extend(notes)
    for e in job["events"][-5:]:
        line = Text(f"  {_when(e['at'])}  {e['kind']}", style="dim")
        if e["step"] is not None:
            line.append(f" step {e['step']}", style="dim")
        if e["rank"] is not None:
            line.append(f" rank {e['rank']}", style="dim")
        if e["reason"]:
            line.append(f": {visible(e['reason'])}", style="dim")  # a tenant's words
        parts.append(line)
    return table, parts


@app.command()
def status(
    job: Annotated[str | None, typer.Argument(help="Only this job.")] = None,
    url: ServerUrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            min=0,
            help="Keep refreshing for this many seconds (0: until Ctrl-C).",
            show_default=False,
        ),
    ] = None,
    every: Annotated[
        float, typer.Option(min=0.1, help="Seconds between refreshes with --watch.")
    ] = 2.0,
) -> None:
    """Live rank health: state, step, last heartbeat, GPU temperature, ECC, host memory."""

    from rich.live import Live

    params: dict[str, Any] = {"steps": 0}
    shown = False
    try:
        if job is not None:
            params["job"] = check_job(job)
        with _server(url, token) as server:
            if job is not None and watch is None:  # --watch may wait for a job to start
                from ckptd.errors import job_not_found

                everything = server.overview({"steps": 0})
                known = {j.job for j in everything.jobs}
                known |= {j.job for j in server.jobs().jobs}
                if job not in known:
                    raise job_not_found(job, sorted(known), url)
            overview = _overview(server, params)
            view = _with_notes(status_view(overview, console.width), server)
            if watch is None:
                console.print(view)
                return
            deadline = time.monotonic() + watch if watch > 0 else None
            shown = True  # (the ranks in hand, on the screen from the Live's start)
            if not console.is_terminal:
                _watch_plain(server, params, view, deadline, every)
                return
            with Live(view, console=console, refresh_per_second=4) as live:
                while deadline is None or time.monotonic() < deadline:
                    pause = every if deadline is None else min(every, deadline - time.monotonic())
                    time.sleep(max(0.0, pause))
                    live.update(_with_notes(status_view(_overview(server, params), console.width),
                                         server))
    except CkptdError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        # Ctrl-C is how a --watch ends once it has shown the ranks: done (0). Before
        # any answer (a one-shot, or a watch whose server has not answered yet) the
        # command did not do what was asked: 130, as the shell's convention has it,
        # so that `ckptd status && ...` does not go on as if it had answered.
        if not shown:
            raise typer.Exit(code=130) from None


def _watch_plain(server: Any, params: dict[str, Any], view: Any, deadline: float | None,
                 every: float) -> None:
    """``--watch`` into a pipe or a log (``kubectl logs``, a file): a frame at each
    refresh, under a line with its time. (A Live draws in place on a terminal only;
    elsewhere it drew once, when the watch ended: nothing to read meanwhile.)"""
    while True:
        console.print(f"-- {_when(time.time())} UTC", markup=False, highlight=False)
        console.print(view)
        left = every if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(every, left))
        view = _with_notes(status_view(_overview(server, params), console.width), server)


def _overview(server: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/overview`` of ``params``; a job no one knows yet (a ``--watch``
    started before its job: the only caller that asks for one unchecked) is shown
    as a job with no ranks yet, until its first heartbeat."""
    try:
        return dict(server.overview(params).model_dump(mode="json"))
    except JobNotFound:
        from ckptd.api import JobView

        doc = dict(server.overview({"steps": 0}).model_dump(mode="json"))
        doc["jobs"] = [JobView(job=params["job"], latest=None, world_size=None,
                               snapshot_at=None, snapshot_reason=None, rollback_to=None,
                               ranks=[], steps=[], events=[]).model_dump(mode="json")]
        return doc


# The store's GC phases that hold saves (a sweep) or are about to (marking), or
# fail them (a damaged state, one a newer ckptd wrote).
_HOLDING = ("marking", "sweeping", "damaged", "unsupported")


def _with_notes(view: Any, server: Any) -> Any:
    """The view, and under it the replicas routing left out (they serve another
    store than the URL given: ``client/routing.py``) and what the store's garbage
    collection holds, when a
    collection is running (saves wait while it sweeps, two minutes at most when its
    collector stopped, and a rank's log says nothing of it) or its state fails saves.
    Left out when the server does not say (an older one, a token without access to
    the store's state)."""
    from rich.console import Group
    from rich.text import Text

    lines = [Text(f"replica {url} serves another store (store id {sid[:8]}): left out; "
                  "fix its --store", style="yellow")
             for url, sid in sorted(server.members.left_out.items())]
    try:
        state = server.gc_status().state
    except CkptdError:
        state = {}
    if state.get("phase") in _HOLDING and isinstance(state.get("note"), str):
        # (the note's "is already marking" is a refused collection's words)
        note = visible(state["note"]).replace(" is already ", " is ")
        lines.append(Text(f"gc: {note}", style="yellow"))
    return Group(view, *lines) if lines else view
