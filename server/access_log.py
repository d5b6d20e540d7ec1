"""The access log without secrets: a token a client put in a URL's query (a script's
``?token=...``, refused with 401: tokens go in the Authorization header) was written
to the log whole, where anyone who reads the server's log could take it."""

from __future__ import annotations

import logging
import re

# Query parameters whose values are secrets, by the names scripts give them.
_SECRET_PARAMS = re.compile(
    r"(?i)([?&](?:token|access_token|auth|authorization|key|api_key|apikey|password|secret|"
    r"peer_token)=)[^&#\s]*")
# A scoped token wherever it stands (``ckptd token create``'s form).
_CKPTD_TOKEN = re.compile(r"ckptd_[0-9a-f]{8}_[A-Za-z0-9_-]+")
HIDDEN = "(hidden)"


def hide_secrets(path: str) -> str:
    """``path`` (and its query) with every secret's value hidden."""
    path = _SECRET_PARAMS.sub(lambda m: m.group(1) + HIDDEN, path)
    return _CKPTD_TOKEN.sub(HIDDEN, path)


class HideSecrets(logging.Filter):
    """On uvicorn's access log handler: its record's path, hidden where it holds one.
    (Its args are (client, method, path with query, HTTP version, status).)"""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], hide_secrets(args[2]), *args[3:])
        return True
