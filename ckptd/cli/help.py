"""How ``ckptd --help`` lists commands: each summary is its first sentence, whole
and wrapped, never cut at the terminal's width."""

from __future__ import annotations

from typing import Any

from typer.core import TyperGroup

# A summary longer than this is a paragraph, not a sentence: cut there.
SUMMARY_LIMIT = 300


class HelpGroup(TyperGroup):
    """A command group whose command list wraps summaries instead of cutting them."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(SUMMARY_LIMIT)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
