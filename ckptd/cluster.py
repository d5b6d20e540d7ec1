"""Replicas over one store: rendezvous (highest random weight) hashing of chunk ids
and jobs onto the live members, the member lease document, and the store's id.

Pure: the server keeps the membership (``ckptd.server.cluster``), the client routes
with it (``ckptd.client.routing``); both agree on a key's home through this module.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import json
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import ParseResult, urlparse

from ckptd.errors import InvalidDocument, InvalidRequest, Unavailable

__all__ = [
    "MEMBERS_PREFIX",
    "STORE_ID_KEY",
    "Member",
    "StoreIdentity",
    "chunk_key",
    "home",
    "job_key",
    "member_key",
    "normalize_url",
    "parse_url",
    "parse_urls",
    "rank_members",
    "route_key",
    "store_mismatch",
    "weight",
]

#: where members keep their leases in the store
MEMBERS_PREFIX = "cluster/members/"
#: the store's id, written once by the first server over it
STORE_ID_KEY = "cluster/store-id"

_MEMBER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_STORE_ID = re.compile(r"^[0-9a-f]{32}$")
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


def loopback_host(host: str) -> bool:
    """Whether ``host`` (a URL's host, or an address to listen on; brackets allowed)
    is this host only: ``localhost`` or a loopback address. A name is not (it may
    resolve beyond loopback)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def normalize_url(url: str) -> str:
    """``http(s)://host:port`` without a trailing slash; an error for anything else."""
    url = url.strip().rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidRequest(f"replica URL {url!r} is not http(s)://host:port")
    return url


def parse_url(url: str, use: str = "http://host:port or file:///path") -> ParseResult:
    """``urlparse(url)``; its ValueError for what is no URL (``http://[::1``, an
    address without its bracket) said as ``InvalidRequest`` in a line, with ``use``."""
    try:
        return urlparse(url)
    except ValueError as exc:
        raise InvalidRequest(f"URL {url!r} is not a URL ({exc}): use {use}") from None


def _server_url(url: str) -> str:
    """``normalize_url(url)``, refusing in a line a server URL that names no host, a
    port that is not one (``:notaport``, ``:99999``, ``:0``) or an IPv4 address that
    is not one: the HTTP stack's own errors for them were tracebacks."""
    url = url.strip()
    parsed = parse_url(url, "http://host:port")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError as exc:
        raise InvalidRequest(f"server URL {url!r}: {exc}; use http://host:port") from None
    if parsed.scheme in ("http", "https") and not host:
        raise InvalidRequest(f"server URL {url!r} names no host; use http://host:port")
    if port == 0:
        raise InvalidRequest(f"server URL {url!r}: port 0 is no server's; use http://host:port")
    if host and host.replace(".", "").isdigit():
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise InvalidRequest(f"server URL {url!r}: {host} is not an IP address") from None
    return normalize_url(url)


def parse_urls(text: str) -> list[str]:
    """A comma-separated list of server URLs (``http://a:8470,http://b:8470``), in
    order, without duplicates; ``InvalidRequest`` in a line for a malformed one."""
    urls: list[str] = []
    for part in text.split(","):
        if part.strip():
            url = _server_url(part)
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


@dataclass(frozen=True, slots=True)
class StoreIdentity:
    """Which store this is: a random id that the first ``ckptd serve`` over the store
    writes (put-if-absent) and every later one reads. Replicas whose stores have
    different ids serve different stores, and are no replicas of one cluster."""

    id: str
    created_at: float

    @classmethod
    def new(cls) -> StoreIdentity:
        return cls(uuid.uuid4().hex, round(time.time(), 3))

    def to_json(self) -> bytes:
        doc = {"id": self.id, "created_at": self.created_at}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> StoreIdentity:
        try:
            doc = json.loads(data)
            identity = cls(str(doc["id"]), float(doc["created_at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidDocument(f"store id {STORE_ID_KEY} does not parse: {exc}") from None
        if not _STORE_ID.match(identity.id):
            raise InvalidDocument(f"store id {STORE_ID_KEY} is not 32 hex digits")
        return identity


def majority_store(ids: Iterable[tuple[str, str | None]]) -> str | None:
    """The store id more than half of the replicas (URL, store id) that said one
    serve; None when none has more than half (two replicas, one on each store, or
    none said an id)."""
    known = [sid for _, sid in ids if sid]
    if not known:
        return None
    top, count = collections.Counter(known).most_common(1)[0]
    return top if 2 * count > len(known) else None


def store_mismatch(ids: Iterable[tuple[str, str | None]]) -> str | None:
    """One line naming two of the replicas (URL, store id) that serve different
    stores; None when they agree. A replica without an id (a server from before
    store ids, one that could not read its store's) is compared with none."""
    known = [(url, sid) for url, sid in ids if sid]
    for url, sid in known[1:]:
        first, first_id = known[0]
        if sid != first_id:
            return (f"{first} and {url} serve different stores (store ids {first_id[:8]} "
                    f"and {sid[:8]}, {STORE_ID_KEY}): replicas of one cluster must serve "
                    "one store; start every replica with the same --store, or give the URL "
                    "of one server (docs/replicas.md)")
    return None
