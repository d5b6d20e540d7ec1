"""Housekeeping at start: temporary files a killed server left in a local store."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ckptd.store.base import Store
from ckptd.store.local import LocalStore

log = logging.getLogger(__name__)

_TMP = ".tmp-"  # LocalStore's temporary names (docs/FORMAT.md, "Store layout")


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
        log.info("removed %d temporary files (%d bytes) left by a stopped server",
                 removed, nbytes)
    return removed, nbytes
