"""User tags on committed steps (``jobs/<job>/refs/tags``): kept by retention."""

from __future__ import annotations

import re

from ckptd.documents import parse_stored
from ckptd.errors import Conflict, InvalidName, NotFound, StoreCorrupt
from ckptd.format import MAX_STEP, check_job, check_step
from ckptd.lifecycle.documents import Tags, tags_key
from ckptd.store.base import Store

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
    the document, and the way out, when it is damaged."""
    key = tags_key(check_job(job))
    try:
        data = await store.get(key)
    except NotFound:
        return {}
    return _parse(store, job, key, data)


def _parse(store: Store, job: str, key: str, data: bytes) -> dict[str, int]:
    """The tags in ``data``; ``StoreCorrupt`` when they do not parse, or name a tag
    or a step no tag can have (read, such a tag was a 400 to whoever asked for it)."""
    try:
        tags = dict(parse_stored(Tags.parse, data, key).tags)
    except StoreCorrupt as exc:
        raise _damaged(store, job, exc.message, **exc.detail) from None
    for name, step in tags.items():
        if not TAG_RE.fullmatch(name):
            raise _damaged(store, job, f"damaged document {key}: {name[:80]!r} is no tag name",
                           key=key)
        if not 0 <= step < MAX_STEP:
            raise _damaged(store, job, f"damaged document {key}: tag {name!r} names step "
                           f"{step}, which no step can be", key=key)
    return tags


def _damaged(store: Store, job: str, said: str, **detail: object) -> StoreCorrupt:
    """``StoreCorrupt`` for a damaged tags document, saying the way out. ckptd does
    not replace it: a tag written over it would drop the tags it held without a word."""
    key = tags_key(job)
    path = store.local_path(key)
    where = str(path) if path is not None else f"{key} from {store.describe()}"
    return StoreCorrupt(f"{said}; fix it, or remove {where} (the tags it held are lost, no "
                        f"checkpoint is) and tag again with `ckptd tag {job} STEP NAME`",
                        **{**detail, "key": key})


async def _change(store: Store, job: str, name: str, step: int | None,
                  naming: int | None = None) -> bool:
    key = tags_key(check_job(job))
    for _ in range(100):
        try:
            current: bytes | None = await store.get(key)
        except NotFound:
            current = None
        # A damaged document raises: the tags it held are not known, and a tag
        # written over it would drop them without a word.
        tags = _parse(store, job, key, current) if current is not None else {}
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
