"""Retention's removal claims (``removal_key``) as a commit meets them: one that
does not parse is damage, never a live pass's, and must not hold a step forever."""

from __future__ import annotations

import json
import logging

from ckptd.documents import unsupported_stored
from ckptd.errors import NotFound, UnsupportedFormat, UnsupportedStoredFormat
from ckptd.format import FORMAT_VERSION, removal_key
from ckptd.store.base import Store

log = logging.getLogger(__name__)

REMOVAL_FORMAT = "ckptd.removal"  # (retention writes the claim)


def claim_since(held: bytes) -> float | None:
    """When the pass that wrote a removal claim began, or None for a claim that does
    not parse (damage: no live pass wrote it)."""
    try:
        return float(json.loads(held)["since"])
    except (ValueError, KeyError, TypeError):
        return None


async def drop_damaged_claim(store: Store, job: str, step: int) -> bool:
    """Deletes the removal claim of ``step`` when it does not parse (compare-and-delete
    against those bytes: a pass that replaced it meanwhile keeps its own); True then."""
    key = removal_key(job, step)
    try:
        held = await store.get(key)
    except NotFound:
        return False
    if claim_since(held) is not None:
        return False  # a readable claim: a live pass's, or a stale one retention takes over
    log.warning("removing the damaged removal claim %s (%d bytes)", key, len(held))
    return await store.compare_and_delete(key, held)


def newer_claim(held: bytes, key: str) -> UnsupportedStoredFormat | None:
    """The error for a removal claim of a format version above this ckptd's (a newer
    ckptd's retention wrote it), else None: one that does not parse is damage, and
    ``drop_damaged_claim``'s."""
    try:
        doc = json.loads(held)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != REMOVAL_FORMAT:
        return None
    version = doc.get("version")
    if type(version) is not int or version <= FORMAT_VERSION:
        return None
    return unsupported_stored(UnsupportedFormat(
        f"removal claim has format version {version}; this ckptd reads version "
        f"{FORMAT_VERSION}", version=version), key)
