"""``CKPTD_*`` variables set that ckptd does not read, said on stderr by every
command (``ckptd.variables``)."""

from __future__ import annotations

from collections.abc import Mapping


def say_unknown_variables(environ: Mapping[str, str]) -> None:
    """Warns on stderr of each ``unknown_variables`` of ``environ``."""
    from rich.markup import escape

    from ckptd.cli import err_console
    from ckptd.variables import unknown_variables

    for line in unknown_variables(environ):
        err_console.print(f"[yellow]warning[/] {escape(line)}", soft_wrap=True, highlight=False)
