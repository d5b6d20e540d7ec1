"""Does a store write conditionally, as the commit protocol needs?

Refs, leases and commit records change only by put-if-absent and compare-and-swap
(docs/FORMAT.md). A store that takes the call and ignores the condition (an S3
front or gateway that drops ``If-None-Match`` / ``If-Match``) lets two writers
both win: two commit records of one step, a ``latest`` moved backwards. So
``ckptd serve`` probes its store first (``ckptd serve --check`` only that), at
``cluster/probes/<random>-<name>``, and removes what it wrote:

- a put-if-absent of an existing object must fail and leave it as it was;
- a compare-and-swap from a stale value must fail; on S3, a write with a stale
  ETag (``If-Match``) too, which the swap's own read would otherwise hide;
- of ``writers`` concurrent put-if-absents of one new object, and of as many
  compare-and-swaps from one value, at most one may win, and the object must then
  hold its bytes (else still the old ones). None winning is no gap: a store may
  turn racing conditional writes all away (S3's 409), and the callers retry.

Probes of replicas starting together never meet (each its own random keys), and
a probe leaves nothing behind (on a local directory, not its lock files either):
it deletes the keys it wrote to; after a failure or when cancelled, in one try of
at most ``connect_timeout`` (a store that did not answer the probe will not answer
its deletes either: retrying them held ``serve`` for minutes)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid

from ckptd import knobs
from ckptd.errors import CkptdError, NotFound
from ckptd.store.base import Store
from ckptd.store.local import LocalStore

PROBE_PREFIX = "cluster/probes/"
WRITERS = 8


async def _value(store: Store, key: str) -> bytes | None:
    try:
        return await store.get(key)
    except NotFound:
        return None


async def _stale_etag(store: Store, key: str) -> str | None:
    """On S3: what is wrong when a write with an ETag the object no longer has
    succeeds (the gateway dropped ``If-Match``); None elsewhere or when it fails."""
    s3 = sys.modules.get("ckptd.store.s3")  # loaded if the store is one (aiobotocore)
    if s3 is None or not isinstance(store, s3.S3Store):
        return None
    before, etag = await store._get_with_etag(key)
    if not await store.compare_and_swap(key, before, before + b"+"):
        return "a compare-and-swap of an object nobody else writes failed"
    if await store._put(key, b"stale", read_back=False, IfMatch=etag):
        return "a write with a stale ETag succeeded (If-Match is ignored)"
    return None


def _one_winner(won: list[bool], bodies: list[bytes], kept: bytes | None,
                before: bytes | None) -> bool:
    """Whether a race ended as a conditional write must: one winner whose bytes
    stay, or none and the object as it was."""
    if sum(won) > 1:
        return False
    return kept == (bodies[won.index(True)] if any(won) else before)


async def _forget(store: Store, keys: list[str], *, failed: bool) -> None:
    """Deletes ``keys``, the probe's; after a failure (``failed``), one bounded try."""
    async def delete_all() -> None:
        for key in keys:
            await store.delete(key)

    with contextlib.suppress(CkptdError, OSError, TimeoutError):
        if failed:
            limit = knobs.connect_timeout()  # (read first: a bad value leaves no coroutine)
            await asyncio.wait_for(delete_all(), limit)
        else:
            await delete_all()
    if isinstance(store, LocalStore):  # one lock file per probe and start, else
        for key in keys:
            with contextlib.suppress(OSError):
                store.forget_ref_lock(key)


async def _race_creates(store: Store, key: str, writers: int) -> str | None:
    bodies = [f"writer {i}".encode() for i in range(writers)]
    won = await asyncio.gather(*(store.put_if_absent(key, b) for b in bodies))
    if not _one_winner(won, bodies, await _value(store, key), None):
        return (f"{sum(won)} of {writers} concurrent put-if-absents of one new object "
                "won (at most one may), or its bytes are not the winner's")
    return None


async def _race_swaps(store: Store, key: str, writers: int) -> str | None:
    start = b"start"
    if not await store.put_if_absent(key, start):
        return "a put-if-absent of a new object failed"
    bodies = [f"swap {i}".encode() for i in range(writers)]
    won = await asyncio.gather(*(store.compare_and_swap(key, start, b) for b in bodies))
    if not _one_winner(won, bodies, await _value(store, key), start):
        return (f"{sum(won)} of {writers} concurrent compare-and-swaps from one value "
                "won (at most one may), or its bytes are not the winner's")
    return None


async def conditional_write_gaps(store: Store, *, writers: int = WRITERS) -> list[str]:
    """What ``store`` lacks of conditional writes; empty when it has them all."""
    base = f"{PROBE_PREFIX}{uuid.uuid4().hex}-"  # (flat: no directory left per probe)
    gaps: list[str] = []
    written: list[str] = []  # keys a write went to (one that failed may have landed)

    def key(name: str) -> str:
        written.append(base + name)
        return base + name

    try:
        absent = key("absent")
        await store.put_if_absent(absent, b"first")
        if await store.put_if_absent(absent, b"second") or (
                await _value(store, absent) != b"first"):
            gaps.append("a put-if-absent replaced an existing object (If-None-Match is "
                        "ignored)")
        ref = key("ref")
        await store.put_if_absent(ref, b"one")
        if not await store.compare_and_swap(ref, b"one", b"two"):
            gaps.append("a compare-and-swap from the current value of an object nobody "
                        "else writes failed (refs could never move)")
        elif await store.compare_and_swap(ref, b"one", b"three") or (
                await _value(store, ref) != b"two"):
            gaps.append("a compare-and-swap from a stale value succeeded")
        elif (stale := await _stale_etag(store, ref)) is not None:
            gaps.append(stale)
        for race, name in ((_race_creates, "race-create"), (_race_swaps, "race-swap")):
            if (gap := await race(store, key(name), writers)) is not None:
                gaps.append(gap)
    except BaseException:  # (CancelledError too: a bounded try, then on)
        await _forget(store, written, failed=True)
        raise
    await _forget(store, written, failed=False)
    return gaps
