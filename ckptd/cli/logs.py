"""How log records read on the CLI's stderr: a command's warnings as its own lines
read (``warning: ...``); a server's (``ckptd serve``) and ``--verbose`` ones with
their time, level and logger, as a daemon's log is read."""

from __future__ import annotations

import logging

_DAEMON = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Plain(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        return f"{line}\n{record.exc_text}" if record.exc_text else line


# Libraries whose debug records carry secrets: botocore logs every request's headers
# (``Authorization``, an STS session token) and its parameters. ``--verbose`` shows
# their INFO records and ckptd's debug ones, never those.
_SECRET_DEBUG = ("botocore", "aiobotocore", "boto3", "s3transfer", "urllib3", "aiohttp")


def command_logging(verbose: bool) -> None:
    """Every command's logging, before it runs (``--verbose``: debug records too)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format=_DAEMON)
    for name in _SECRET_DEBUG:  # (without --verbose they take the root's WARNING)
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.NOTSET)
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.setFormatter(_Plain())


def server_logging() -> None:
    """``ckptd serve``'s: ckptd's records from INFO on, each with its time and logger."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(_DAEMON))
    logging.getLogger("ckptd").setLevel(logging.INFO)
