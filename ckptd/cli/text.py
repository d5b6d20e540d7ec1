"""Text the commands print that others wrote (a reason, a server's message)."""

from __future__ import annotations

import re

# Control characters (C0, DEL, C1) and the bidirectional overrides: printed as they
# came, an escape sequence in a tenant's text would act on the terminal (colours, a
# cleared screen, a line forged after a newline).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """``text`` (a reason, a message a server or a tenant wrote) with its control
    characters written out as Python writes them (``\\n``, ``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
