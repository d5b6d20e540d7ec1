"""What ``ckptd restore`` says after its ``ok`` line: why a restore of latest took an
older step, and the sources that fell short (each chunk then came from the next),
one line per source and kind, not one Python repr per chunk."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.markup import escape

from ckptd.cli.text import visible


def restore_notes(problems: Iterable[Any], step: int) -> list[str]:
    """Rich-markup lines of a finished restore's ``problems`` (``ChunkProblem``)."""
    lines: list[str] = []
    short: dict[tuple[str, str, str], list[Any]] = {}
    for problem in problems:
        if problem.kind == "damaged":  # (what made a restore of latest take an older step)
            lines.append(f"[yellow]latest skipped[/]: restored step {step}, the newest "
                         f"restorable one: {escape(visible(problem.message))}")
        else:
            short.setdefault((problem.tier, problem.source, problem.kind), []).append(problem)
    for (tier, source, kind), some in short.items():
        n = len(some)
        where = source if source == tier or tier in source else f"{tier} {source}"
        lines.append(
            f"[yellow]a source fell short[/]: {escape(visible(where))}: {kind} for {n} "
            f"chunk{'s' if n != 1 else ''} ({escape(visible(some[0].message))}); "
            f"{'each' if n != 1 else 'it'} came from the next source, verified")
    return lines
