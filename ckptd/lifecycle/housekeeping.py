"""Housekeeping: temporary files a killed writer left in a local store, removed at a
server's start and by every garbage collection."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ckptd.knobs import _env_float
from ckptd.store.base import Store
from ckptd.store.local import LocalStore

log = logging.getLogger(__name__)

_TMP = ".tmp-"  # LocalStore's temporary names (docs/FORMAT.md, "Store layout")


def stale_after() -> float:
    """Seconds after which a temporary is a dead writer's: the longest upload
    (``CKPTD_MAX_UPLOAD_S``, as the server reads it; 3600 s by default). Every writer
    writes a temporary whole, then links it: a live one's is younger."""
    return _env_float("CKPTD_MAX_UPLOAD_S", 3600.0, above=0)


def _remove(root: str, older_than: float) -> tuple[int, int]:
    removed = nbytes = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".locks"]
        for name in filenames:
            if not name.startswith(_TMP):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
                if st.st_mtime >= older_than:
                    continue  # maybe a live upload's, of this or another server
                os.unlink(path)
            except FileNotFoundError:
                continue  # its writer linked and removed it just now
            removed += 1
            nbytes += st.st_size
    return removed, nbytes


async def remove_stale_temporaries(
    store: Store, *, max_upload_s: float, now: float | None = None
) -> tuple[int, int]:
    """Removes a local store's temporary files older than the longest upload
    (``max_upload_s``): no live writer, of this server or another sharing the
    directory, can still own them. Returns (files, bytes) removed."""
    if not isinstance(store, LocalStore):
        return 0, 0  # object stores write whole objects: nothing half-written stays
    cutoff = (time.time() if now is None else now) - max_upload_s
    removed, nbytes = await asyncio.to_thread(_remove, str(store.root), cutoff)
    if removed:
        log.info("removed %d temporary files (%d bytes) left by a stopped writer",
                 removed, nbytes)
    return removed, nbytes
