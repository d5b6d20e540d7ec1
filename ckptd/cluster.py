"""Replicas over one store: rendezvous (highest random weight) hashing of chunk ids
and jobs onto the live members, and the member lease document.

Pure: the server keeps the membership (``ckptd.server.cluster``), the client routes
with it (``ckptd.client.routing``); both agree on a key's home through this module.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlparse

from ckptd.errors import InvalidDocument, InvalidRequest, Unavailable

__all__ = [
    "MEMBERS_PREFIX",
    "Member",
    "chunk_key",
    "home",
    "job_key",
    "member_key",
    "normalize_url",
    "parse_urls",
    "rank_members",
    "route_key",
    "weight",
]

#: where members keep their leases in the store
MEMBERS_PREFIX = "cluster/members/"

_MEMBER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_CHUNK_PATH = re.compile(r"^/v1/chunks/([0-9a-f]{64})$")
_JOB_PATH = re.compile(r"^/v1/jobs/([^/]+)/.+$")


def weight(member: str, key: str) -> int:
    """The member's random weight for ``key``: 64 bits of blake2b of both."""
    digest = hashlib.blake2b(f"{member}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank_members(key: str, members: Iterable[str]) -> list[str]:
    """The members in rendezvous order for ``key``: its home first, then where it
    goes when the home is gone. Removing a member moves only the keys it was home of."""
    unique = set(members)
    return sorted(unique, key=lambda m: (weight(m, key), m), reverse=True)


def home(key: str, members: Iterable[str]) -> str:
    """The member with the highest weight for ``key``."""
    ranked = rank_members(key, members)
    if not ranked:
        raise Unavailable("no live ckptd replica to route to")
    return ranked[0]


def chunk_key(cid: str) -> str:
    return f"chunk:{cid}"


def job_key(job: str) -> str:
    return f"job:{job}"


def route_key(path: str) -> str | None:
    """The routing key of an API path: a chunk's id, a job's name, or None for calls
    that any replica answers alike (``/healthz``, ``/v1/jobs``, ``/v1/cluster``)."""
    if m := _CHUNK_PATH.match(path):
        return chunk_key(m.group(1))
    if m := _JOB_PATH.match(path):
        return job_key(m.group(1))
    return None


def normalize_url(url: str) -> str:
    """``http(s)://host:port`` without a trailing slash; an error for anything else."""
    url = url.strip().rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidRequest(f"replica URL {url!r} is not http(s)://host:port")
    return url


def parse_urls(text: str) -> list[str]:
    """A comma-separated list of replica URLs (``http://a:8470,http://b:8470``), in
    order, without duplicates."""
    urls: list[str] = []
    for part in text.split(","):
        if part.strip():
            url = normalize_url(part)
            if url not in urls:
                urls.append(url)
    if not urls:
        raise InvalidRequest(f"{text!r} names no replica URL")
    return urls


def member_key(member_id: str) -> str:
    """The store key of a member's lease."""
    if not _MEMBER_ID.match(member_id):
        raise InvalidRequest(
            f"member id {member_id!r} must be 1-128 letters, digits, '.', '_' or '-'"
        )
    return MEMBERS_PREFIX + member_id


@dataclass(frozen=True, slots=True)
class Member:
    """One replica's lease: who, where, and until when (unix seconds) it holds."""

    id: str
    url: str
    expires_at: float

    def to_json(self) -> bytes:
        doc = {"id": self.id, "url": self.url, "expires_at": round(self.expires_at, 3)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes, key: str) -> Member:
        try:
            doc = json.loads(data)
            member = cls(str(doc["id"]), normalize_url(str(doc["url"])),
                         float(doc["expires_at"]))
        except (ValueError, KeyError, TypeError, InvalidRequest) as exc:
            raise InvalidDocument(f"member lease {key} does not parse: {exc}") from None
        return member
