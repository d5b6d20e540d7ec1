"""``ckptd ls``'s tables: jobs, or one job's steps. A job or step whose documents
cannot be read (damaged, or of a newer format) is a row saying so and a note
below the table, never the end of the listing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ckptd.cli.text import visible
from ckptd.errors import CkptdError


def _get(doc: Any, name: str) -> Any:
    return doc.get(name) if isinstance(doc, dict) else getattr(doc, name, None)


@dataclass(slots=True)
class Notes:
    """What a listing could not read, printed after its table."""

    lines: list[str] = field(default_factory=list)
    newer: bool = False  # a document of a newer format: this ckptd must be upgraded
    damaged: bool = False  # a damaged document listed: ``ckptd verify`` names them all

    def unreadable(self, what: str, doc: Any) -> str | None:
        """The table cell for a job or step that cannot be read (noted), or None."""
        if isinstance(why := _get(doc, "damaged"), str):
            self.lines.append(f"[red]damaged[/] {escape(visible(f'{what}: {why}'))}")
            self.damaged = True
            return "[red]damaged[/]"
        if isinstance(why := _get(doc, "unsupported"), str):
            self.lines.append(
                f"[bold red]error[/] {escape(visible(f'[unsupported_format] {what}: {why}'))}")
            self.newer = True
            return "[yellow]unsupported[/]"
        return None

    def print(self, console: Console) -> None:
        for line in self.lines:
            console.print(line, soft_wrap=True)


def _latest_cell(named: int | None, latest: Any, steps: list[Any]) -> str:
    """The latest column: the step a restore of latest gets, and the step the job's
    ref names when that one cannot be read (damaged; unreadable: a newer format)."""
    ref = next((s for s in steps if _get(s, "step") == named), None)
    why = "unreadable" if _get(ref, "unsupported") else "damaged"
    if latest is not None:
        step = _get(latest, "step")
        if named is not None and named != step and (ref is None or _get(ref, "damaged")):
            return f"{step} ({named} {why})"
        return str(step)
    return f"{named} ({why})" if named is not None else "-"


async def jobs_table(transport: Any, notes: Notes) -> Table | str:
    """The jobs' table, or a line saying there is no job (rather than an empty table)."""
    from ckptd.cli import _human

    jobs = await transport.list_jobs()
    if not jobs:
        return (f"no jobs in {escape(transport.describe())} yet: a save creates its job "
                "(is this the store the training writes to?)")
    table = Table("job", "latest", "committed", "pending", "size of latest")
    for j in jobs:
        name = _get(j, "job")
        listed = True
        try:
            steps = await transport.list_steps(name)
        except CkptdError as exc:
            steps, j, listed = [], {"damaged": exc.message, **j}, False
        bad = notes.unreadable(name, j)
        newer = [s for s in steps if _get(s, "unsupported")]
        damaged = [s for s in steps if _get(s, "damaged") and not _get(s, "unsupported")]
        for word, found in (("[yellow]unreadable[/]", newer), ("[red]damaged[/]", damaged)):
            if n := len(found):  # (unreadable: a newer ckptd wrote them)
                notes.lines.append(f"{word} {escape(name)}: {n} "
                                   f"step{'s' if n > 1 else ''} (`ckptd ls {escape(name)}`)")
        notes.newer |= bool(newer)
        notes.damaged |= bool(damaged)
        committed = [s for s in steps if _get(s, "committed")]
        pending = [s for s in steps if not (_get(s, "committed") or _get(s, "damaged")
                                            or _get(s, "unsupported"))]
        latest = next((s for s in steps if _get(s, "is_latest")), None)
        if listed:  # (else no step is known, and the row says why)
            _lost_latest(name, _get(j, "latest"), steps, notes)
        table.add_row(
            escape(name),
            bad or _latest_cell(_get(j, "latest"), latest, steps),
            str(len(committed)),
            str(len(pending)),
            _human(_get(latest, "logical_bytes") if latest else None),
        )
    return table


async def steps_table(transport: Any, job: str, notes: Notes) -> Table:
    from ckptd.cli import _human, _when

    steps = await transport.list_steps(job)
    if not steps:
        from ckptd.errors import job_not_found

        jobs = [_get(j, "job") for j in await transport.list_jobs()]
        raise job_not_found(job, jobs, transport.describe())
    table = Table("step", "state", "ranks", "size", "committed at (UTC)", "")
    stuck: list[str] = []
    tagged = await _tags_by_step(transport, job, notes)
    for s in steps:
        world = _get(s, "world_size")
        bad = notes.unreadable(f"step {_get(s, 'step')}", s)
        if bad is None and not _get(s, "committed") and world is not None and (
                _get(s, "ranks_present") == world):
            stuck.append(str(_get(s, "step")))
            bad = "[yellow]not committed[/]"
        table.add_row(
            str(_get(s, "step")),
            bad or ("[green]committed[/]" if _get(s, "committed") else "[yellow]pending[/]"),
            f"{_get(s, 'ranks_present')}/{world if world is not None else '?'}",
            _human(_get(s, "logical_bytes")),
            _when(_get(s, "committed_at")),
            ", ".join((["latest"] if _get(s, "is_latest") else [])
                      + [f"tag {escape(visible(n))}" for n in tagged.get(_get(s, "step"), [])]),
        )
    if stuck:  # (pending: ranks still to save)
        notes.lines.append(
            f"[yellow]not committed[/] step{'s' if len(stuck) > 1 else ''} {', '.join(stuck)}: "
            "every rank saved and no commit followed: the commit was refused (the ranks' "
            "save errors say why) or is under way. Such steps stay until the job's "
            "retention abandons them (abandon_pending_after, docs/retention.md)")
    if any(_get(s, "committed") for s in steps):
        # The job's latest ref may be one this ckptd cannot read (the job listing
        # says), which is not "nothing to restore", or name a step that is not there.
        for j in await transport.list_jobs():
            if _get(j, "job") == job:
                if not any(_get(s, "is_latest") for s in steps):
                    notes.unreadable(f"{job} latest", j)
                _lost_latest(job, _get(j, "latest"), steps, notes)
    return table


def _lost_latest(job: str, named: int | None, steps: list[Any], notes: Notes) -> None:
    """Notes a ``latest`` ref that names a step the store does not hold (damage: a
    restore of latest falls back past it, as the listing's latest column does)."""
    if named is None or any(_get(s, "step") == named for s in steps):
        return
    got = next((_get(s, "step") for s in steps if _get(s, "is_latest")), None)
    notes.lines.append(
        f"[red]damaged[/] {escape(job)} latest: it names step {named}, which the store "
        f"does not hold; a restore of latest gets {got if got is not None else 'no step'} "
        f"(`ckptd verify {escape(job)}`)")
    notes.damaged = True


async def _tags_by_step(transport: Any, job: str, notes: Notes) -> dict[int, list[str]]:
    """The job's tag names by step (retention keeps a tagged step); a tags document
    that cannot be read is a note, not the end of the listing."""
    try:
        tags = await transport.tags(job)
    except CkptdError as exc:
        notes.lines.append(f"[red]damaged[/] {escape(visible(f'{job} tags: {exc.message}'))}")
        notes.damaged = True
        return {}
    by_step: dict[int, list[str]] = {}
    for name, step in sorted(tags.items()):
        by_step.setdefault(step, []).append(name)
    return by_step
