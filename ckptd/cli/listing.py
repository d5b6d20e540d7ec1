"""``ckptd ls``'s tables: jobs, or one job's steps. A job or step whose documents
cannot be read (damaged, or of a newer format) is a row saying so and a note
below the table, never the end of the listing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ckptd.errors import CkptdError


def _get(doc: Any, name: str) -> Any:
    return doc.get(name) if isinstance(doc, dict) else getattr(doc, name, None)


@dataclass(slots=True)
class Notes:
    """What a listing could not read, printed after its table."""

    lines: list[str] = field(default_factory=list)
    newer: bool = False  # a document of a newer format: this ckptd must be upgraded

    def unreadable(self, what: str, doc: Any) -> str | None:
        """The table cell for a job or step that cannot be read (noted), or None."""
        if isinstance(why := _get(doc, "damaged"), str):
            self.lines.append(f"[red]damaged[/] {escape(f'{what}: {why}')}")
            return "[red]damaged[/]"
        if isinstance(why := _get(doc, "unsupported"), str):
            self.lines.append(f"[bold red]error[/] {escape(f'[unsupported_format] {what}: {why}')}")
            self.newer = True
            return "[yellow]unsupported[/]"
        return None

    def print(self, console: Console) -> None:
        for line in self.lines:
            console.print(line, soft_wrap=True)


async def jobs_table(transport: Any, notes: Notes) -> Table:
    from ckptd.cli import _human

    table = Table("job", "latest", "committed", "pending", "size of latest")
    for j in await transport.list_jobs():
        name = _get(j, "job")
        try:
            steps = await transport.list_steps(name)
        except CkptdError as exc:
            steps, j = [], {"damaged": exc.message, **j}
        bad = notes.unreadable(name, j)
        unreadable = [s for s in steps if _get(s, "damaged") or _get(s, "unsupported")]
        if unreadable:
            n = len(unreadable)
            notes.newer |= any(_get(s, "unsupported") for s in unreadable)
            notes.lines.append(f"[yellow]unreadable[/] {escape(name)}: {n} "
                               f"step{'s' if n > 1 else ''} (`ckptd ls {escape(name)}`)")
        committed = [s for s in steps if _get(s, "committed")]
        latest = next((s for s in steps if _get(s, "is_latest")), None)
        named = _get(j, "latest")  # (a step that cannot be read is not is_latest)
        table.add_row(
            escape(name),
            bad or (str(_get(latest, "step")) if latest else
                    f"{named} (unreadable)" if named is not None else "-"),
            str(len(committed)),
            str(len(steps) - len(committed) - len(unreadable)),
            _human(_get(latest, "logical_bytes") if latest else None),
        )
    return table


async def steps_table(transport: Any, job: str, notes: Notes) -> Table:
    from ckptd.cli import _human, _when

    steps = await transport.list_steps(job)
    if not steps:
        from ckptd.cli.mistakes import job_not_found

        jobs = [_get(j, "job") for j in await transport.list_jobs()]
        raise job_not_found(job, jobs, transport.describe())
    table = Table("step", "state", "ranks", "size", "committed at (UTC)", "")
    for s in steps:
        world = _get(s, "world_size")
        bad = notes.unreadable(f"step {_get(s, 'step')}", s)
        table.add_row(
            str(_get(s, "step")),
            bad or ("[green]committed[/]" if _get(s, "committed") else "[yellow]pending[/]"),
            f"{_get(s, 'ranks_present')}/{world if world is not None else '?'}",
            _human(_get(s, "logical_bytes")),
            _when(_get(s, "committed_at")),
            "latest" if _get(s, "is_latest") else "",
        )
    if any(_get(s, "committed") for s in steps) and not any(_get(s, "is_latest") for s in steps):
        # Committed steps and none is latest: the job's latest ref may be one this
        # ckptd cannot read (the job listing says), which is not "nothing to restore".
        for j in await transport.list_jobs():
            if _get(j, "job") == job:
                notes.unreadable(f"{job} latest", j)
    return table
