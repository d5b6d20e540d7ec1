"""The options and arguments several commands share: what --url takes (each help
names what its command takes), the token, and a step's one spelling."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from ckptd.keys import STEP_PATTERN

# What --url takes differs by command: a server or a store read in this process
# (``open_transport``, the lifecycle commands), or a server only (``_server``). Each
# help names what its command takes.
UrlOpt = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="CKPTD_URL",
        help="http://host:port of a ckptd server (replicas: several, comma-separated), or "
        "a store used directly, with no server: its directory, file:///path or "
        "s3://bucket/prefix.",
    ),
]
ServerUrlOpt = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="CKPTD_URL",
        help="http://host:port of a ckptd server (replicas: several, comma-separated); "
        "this command needs a server, not a store.",
    ),
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="CKPTD_TOKEN", help="Bearer token.")
]
DEFAULT_URL = "http://127.0.0.1:8470"


def step_number(text: str) -> int:
    """A step as the CLI takes it: one spelling, as in the API's URLs (digits, no
    sign, no leading zero): ``05`` is refused, not read as 5."""
    if not re.fullmatch(STEP_PATTERN, text):
        raise typer.BadParameter(f"{text!r} is not a step: write it in digits, with no "
                                 "sign or leading zero (5, not 05)")
    return int(text)


def step_or_latest(text: str) -> int | None:
    """A step, or ``latest`` (None: the command's default)."""
    if text == "latest":
        return None
    try:
        return step_number(text)
    except typer.BadParameter:
        raise typer.BadParameter(f"{text!r} is not a step: write it in digits, with no sign "
                                 "or leading zero (5, not 05), or latest") from None
