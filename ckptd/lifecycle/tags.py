"""User tags on committed steps (``jobs/<job>/refs/tags``): kept by retention."""

from __future__ import annotations

import logging
import re

from ckptd.documents import parse_stored
from ckptd.errors import Conflict, InvalidName, NotFound, StoreCorrupt
from ckptd.format import check_job, check_step
from ckptd.lifecycle.documents import Tags, tags_key
from ckptd.store.base import Store

log = logging.getLogger(__name__)

TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: the commit meta key that tags the step being committed (``ckpt.save(..., tag=)``)
TAG_META = "tag"


def check_tag(name: object) -> str:
    if not isinstance(name, str) or not TAG_RE.fullmatch(name):
        raise InvalidName(
            f"tag {str(name)[:80]!r} must match {TAG_RE.pattern} (letters, digits, '.', '_', '-')"
        )
    return name


# The names of a job's own refs (``jobs/<job>/refs/latest``, ``.../rollback``): a tag
# named so would be read as the ref ("restore latest", Lightning's ckpt_path="latest").
RESERVED_TAGS = frozenset({"latest", "rollback"})


def check_new_tag(name: object) -> str:
    """``check_tag`` of a tag being set: not one of ``RESERVED_TAGS`` either. (Reading
    and removing take any tag name: one set before these were refused can go.)"""
    tag = check_tag(name)
    if tag in RESERVED_TAGS:
        raise InvalidName(f"tag {tag!r} is reserved: the job's {tag} ref has that name; "
                          "choose another name", tag=tag)
    return tag


async def read_tags(store: Store, job: str) -> dict[str, int]:
    """Tag name -> step of ``job`` (empty when it has none); ``StoreCorrupt`` naming
    the document when it is damaged (setting or removing a tag replaces it)."""
    key = tags_key(check_job(job))
    try:
        data = await store.get(key)
    except NotFound:
        return {}
    try:
        return dict(parse_stored(Tags.parse, data, key).tags)
    except StoreCorrupt as exc:  # tags are names only: replacing them loses no data
        raise StoreCorrupt(f"{exc.message}; `ckptd tag {job} STEP NAME` replaces it "
                           "(the tags it held are lost, no checkpoint is)",
                           **exc.detail) from None


async def _change(store: Store, job: str, name: str, step: int | None,
                  naming: int | None = None) -> bool:
    key = tags_key(check_job(job))
    for _ in range(100):
        try:
            current: bytes | None = await store.get(key)
        except NotFound:
            current = None
        try:
            tags = dict(parse_stored(Tags.parse, current, key).tags) if current is not None else {}
        except StoreCorrupt as exc:
            # Its tags are lost already; a tag written now is the repair (swapped
            # against the damaged bytes, so a concurrent repair is not undone).
            log.warning("%s; replacing it, its tags are lost", exc.message)
            tags = {}
        if step is None:
            if name not in tags or (naming is not None and tags[name] != naming):
                return False
            del tags[name]
        else:
            if tags.get(name) == step:
                return True
            tags[name] = step
        if await store.compare_and_swap(key, current, Tags(tags=tags).canonical()):
            return True
    raise Conflict(f"could not change the tags of {job}: too much contention")


async def set_tag(store: Store, job: str, name: str, step: int) -> None:
    """Points tag ``name`` of ``job`` at ``step`` (moving it if it named another)."""
    await _change(store, job, check_new_tag(name), check_step(step))


async def remove_tag(store: Store, job: str, name: str) -> bool:
    """Removes tag ``name``; True when it existed."""
    return await _change(store, job, check_tag(name), None)


async def take_back_tag(store: Store, job: str, name: str, step: int) -> bool:
    """Removes tag ``name`` if it still names ``step`` (a tag just set on a step that
    retention removed meanwhile); True when it did."""
    return await _change(store, job, check_tag(name), None, naming=check_step(step))
