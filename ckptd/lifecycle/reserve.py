"""A local store's space reserve: a file of ``RESERVE_BYTES`` in ``.locks/`` (which
readers ignore) that forgetting and collecting release when the disk is full.

Both write a little before they free anything (a removal claim, ``gc/state``): on a
disk filled to the last byte they could not run, and the advice of ``store_full``
("forget old steps and collect garbage") could not be followed. The reserve is made
at a server's start and after each collection, only while the disk has room for it
several times over; a full disk's first lifecycle write releases it (or, with none
left, stale temporaries: ``housekeeping``) and tries again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from ckptd.errors import StoreFull
from ckptd.knobs import human_bytes
from ckptd.lifecycle.housekeeping import remove_stale_temporaries, stale_after
from ckptd.store.base import Store
from ckptd.store.local import LocalStore

log = logging.getLogger(__name__)

T = TypeVar("T")

RESERVE_BYTES = 1 << 20
#: made only while the disk has this many reserves' worth free (it must never be
#: what fills the disk)
_ROOM_FACTOR = 4
RESERVE_NAME = ".space-reserve"  # in the store's ``.locks/`` (no lock file has this name)

#: What an operator may delete by hand in a full store, and what never.
BY_HAND = ("make room on that disk (files outside the store), or delete in the store only "
           "`.tmp-*` files older than an hour (a stopped writer's leftovers); never a file "
           "under chunks/, jobs/ or gc/ (forget and gc decide what goes), then run it again")


def reserve_path(store: Store) -> Path | None:
    """Where a local store keeps its reserve; None for other backends (S3 never fills)."""
    return store.root / ".locks" / RESERVE_NAME if isinstance(store, LocalStore) else None


def _make(path: Path, size: int) -> bool:
    if path.exists():
        return False
    if shutil.disk_usage(path.parent.parent).free < _ROOM_FACTOR * size:
        return False
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f"{path.name}.new")
    try:
        with open(tmp, "wb") as f:  # written, not sparse: the blocks are really held
            f.write(bytes(size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


async def keep_reserve(store: Store, size: int = RESERVE_BYTES) -> bool:
    """Makes the store's reserve if it has none and the disk has room; True if made."""
    path = reserve_path(store)
    if path is None:
        return False
    made = await asyncio.to_thread(_make, path, size)
    if made:
        log.info("made the store's %s space reserve (%s), released when the disk is full "
                 "so that forget and gc can run", human_bytes(size), path)
    return made


async def release_reserve(store: Store) -> int:
    """Deletes the store's reserve: the bytes freed (0: there was none)."""
    path = reserve_path(store)
    if path is None:
        return 0

    def release() -> int:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    return await asyncio.to_thread(release)


def full_advice(exc: StoreFull) -> StoreFull:
    """``exc`` with what to do when not even the reserve made room."""
    return StoreFull(f"{exc.message}: the store's disk is full and its space reserve is used "
                     f"up; {BY_HAND}", **exc.detail)


async def with_room(store: Store, what: str, write: Callable[[], Awaitable[T]], *,
                    walk: bool = True) -> T:
    """``write()``, a lifecycle write that leads to space freed; on a full disk it
    releases the store's reserve, else (``walk``) stale temporaries, then tries once
    more. ``walk=False`` for a write that must land within a bound (a collection's
    lease renewal: the walk of a large store takes minutes, and a renewal that lands
    after writers stopped waiting for the sweep would let it delete what they then
    committed)."""
    try:
        return await write()
    except StoreFull as exc:
        freed = await release_reserve(store)
        # (only without a reserve: the walk of a large store takes minutes)
        stale = 0 if freed or not walk else (await remove_stale_temporaries(
            store, max_upload_s=stale_after()))[1]
        if not freed + stale:
            raise full_advice(exc) from None
        log.warning("the store's disk is full: released %s (its space reserve and stale "
                    "temporaries) to %s; forget old steps and collect garbage to free more",
                    human_bytes(freed + stale), what)
    try:
        return await write()
    except StoreFull as exc:
        raise full_advice(exc) from None
