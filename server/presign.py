"""Reads that skip the server: a restore plan over an S3-compatible store carries a
presigned GET URL for each chunk of the rank's manifest, so that the rank reads its
chunks straight from the object store (and verifies each, as from any source) and
this server carries no restore bytes.

Scoped and short-lived: one URL per chunk the committed manifest names, signed only
for a caller the plan's route already let read the job, valid for
``presigned_read_seconds`` (default 15 minutes). A URL is the signature of one GET
of one object: it carries the access key's id, never its secret and never this
server's token. The store decides whether it can sign (``presign_reads``, the S3
store); any other store, ``CKPTD_PRESIGNED_READS=false``, or a signing failure gives
a plan without URLs, and the rank reads through the server as before."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import cast

from ckptd.format import chunk_key
from ckptd.store import Store

from .settings import Settings

log = logging.getLogger(__name__)

Presign = Callable[[Sequence[str], int], Awaitable[list[str] | None]]


async def chunk_reads(store: Store, settings: Settings, ids: Iterable[str]
                      ) -> tuple[dict[str, str], int] | None:
    """Presigned GET URLs of chunks ``ids`` (id -> URL) and the seconds they stay
    valid; None when this server offers no direct reads."""
    presign = cast("Presign | None", getattr(store, "presign_reads", None))
    if not settings.presigned_reads or presign is None:
        return None
    wanted = sorted(set(ids))
    seconds = settings.presigned_read_seconds
    try:
        urls = await presign([chunk_key(cid) for cid in wanted], seconds)
    except Exception as exc:  # a plan without URLs still restores, through this server
        log.warning("cannot presign chunk reads on %s: %s", store.describe(), exc)
        return None
    if urls is None or len(urls) != len(wanted):
        return None
    return dict(zip(wanted, urls, strict=True)), seconds
