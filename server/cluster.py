"""Membership: which ckptd replicas serve this store now.

Three modes. ``single``: this server alone. ``static``: the list given by ``--peers``
(``CKPTD_PEERS``), the shape of a Kubernetes StatefulSet's stable names. ``lease``:
each replica keeps a lease ``cluster/members/<id>`` in the store, renewed every
third of its time to live, and lists the leases that have not run out. Leases
change only by compare-and-swap, like refs; expiry compares wall clocks, so the
replicas' clocks must agree to well within the time to live (NTP does).

In every mode the server reads the store's id (``cluster/store-id``, written by the
first server over the store) at start, and ``GET /v1/cluster`` shows it: clients and
the CLI compare the replicas' ids, so a list of servers over different stores is
refused before a save fails (``ckptd.cluster.store_mismatch``). In ``static`` mode
each replica also asks its peers for theirs now and then, and says in its log a peer
that serves another store (``server/cluster_peers.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from typing import Literal
from urllib.parse import urlparse

from ckptd.api import ClusterMember, ClusterView
from ckptd.cluster import (
    MEMBERS_PREFIX,
    STORE_ID_KEY,
    Member,
    StoreIdentity,
    member_key,
    normalize_url,
    parse_urls,
)
from ckptd.errors import CkptdError, NotFound
from ckptd.server.cluster_peers import PeerStores
from ckptd.store.base import Store

log = logging.getLogger(__name__)

Mode = Literal["single", "static", "lease"]

# Seconds a starting server waits for its store's id (a store that hangs: it serves
# without one, and nothing compares it).
IDENTIFY_WITHIN = 10.0


def default_member_id(url: str) -> str:
    """``host_port`` of the URL, in the characters a member id may use."""
    netloc = urlparse(url).netloc
    return re.sub(r"[^A-Za-z0-9._-]", "_", netloc)[:128] or "ckptd"


def every_interface(url: str) -> bool:
    """Whether ``url``'s host is the address of every interface (``0.0.0.0``, ``::``):
    what ``--host`` listens on, never where another host reaches this one."""
    return (urlparse(url).hostname or "") in ("0.0.0.0", "::")


def own_member_id(url: str) -> str:
    """This replica's default lease name: ``host_port`` of its URL, or this host's
    name and the port when that host is every interface's address (the same
    ``0.0.0.0_8470`` in every container: their leases were one, listed once)."""
    if not every_interface(url):
        return default_member_id(url)
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return default_member_id(f"http://{socket.gethostname()}:{port}")


async def store_identity(store: Store) -> tuple[str, bool]:
    """The store's id, ``cluster/store-id``, written first when the store has none:
    by put-if-absent, so that of replicas starting together over a new store one
    id wins and every one reads it; and whether this call wrote it."""
    try:
        return StoreIdentity.parse(await store.get(STORE_ID_KEY)).id, False
    except NotFound:
        pass
    mine = StoreIdentity.new()
    if await store.put_if_absent(STORE_ID_KEY, mine.to_json()):
        return mine.id, True
    return StoreIdentity.parse(await store.get(STORE_ID_KEY)).id, False


def membership_mode(peers: list[str], leases: bool) -> Mode:
    """``static`` over a list of replicas, ``lease`` with leases, else ``single``."""
    return "static" if peers else "lease" if leases else "single"


def membership_warnings(self_url: str, peers: list[str], mode: Mode) -> list[str]:
    """What a replica that calls itself ``self_url`` (normalized) warns of as it
    starts (``serve --check`` says it too): an address no other host reaches, or
    a URL its ``--peers`` do not list."""
    if mode != "single" and every_interface(self_url):
        return [f"this replica advertises {self_url}, the address of every interface, which "
                "no client or other replica can reach: give --advertise-url "
                "(CKPTD_ADVERTISE_URL) http://<a name or address other hosts reach it by>:"
                f"{urlparse(self_url).port}"]
    if mode == "static" and self_url not in peers:
        # (routing by the list finds no key this replica is home of: the chunks a
        # scoped token may name, its jobs' commits, all go to the others)
        return [f"this replica's URL {self_url} is not in --peers ({','.join(peers)}): "
                "clients and replicas route by that list; give --advertise-url the URL "
                "--peers names this replica by"]
    return []


# Seconds past one lease that a member's lease may run out before its clock is said
# to run ahead of this one's.
SKEW_SAY_S = 2.0


class Membership:
    """This replica's view of the live replicas (``view()``), and its own lease."""

    def __init__(
        self,
        store: Store,
        self_url: str,
        *,
        peers: str | None = None,
        leases: bool = False,
        member_id: str | None = None,
        ttl: float = 10.0,
        token: str | None = None,
        peer_check_s: float = 0.0,
    ) -> None:
        self.store = store
        self.self_url = normalize_url(self_url)
        self.peers = parse_urls(peers) if peers else []
        self.mode = membership_mode(self.peers, leases)
        self.member_id = member_id or own_member_id(self.self_url)
        self.key = member_key(self.member_id)
        self.ttl = float(ttl)
        self._lease: bytes | None = None  # what this replica last wrote
        self._wrote: bytes | None = None  # (and only that: a lease it took over is not)
        self._collided = False  # said that another live replica has this id
        self._task: asyncio.Task[None] | None = None
        self._cached: tuple[float, list[Member]] | None = None
        self._skewed: set[str] = set()  # members whose clock was said to run ahead
        self.store_id: str | None = None  # (None: not read; nothing compares it)
        self._created = False  # this replica wrote the store's id as it started
        self._token = token  # (shown to peers: the token replicas share)
        self.peer_check_s = peer_check_s  # 0: peers' stores never compared
        self.peer_stores: PeerStores | None = None
        self._peer_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Reads the store's id; in lease mode, takes the lease now (the server is
        then listed at once) and renews it in the background."""
        self.store_id = await self._identify()
        for line in membership_warnings(self.self_url, self.peers, self.mode):
            log.warning("%s", line)
        if self.mode == "static" and self.store_id is not None and self.peer_check_s > 0:
            self.peer_stores = PeerStores(self.self_url, self.peers, self.store_id,
                                          self.store.describe(), token=self._token,
                                          created=self._created)
            self._peer_task = asyncio.create_task(self.peer_stores.run(self.peer_check_s),
                                                  name="ckptd-peer-stores")
        if self.mode != "lease":
            return
        await self.renew()
        self._task = asyncio.create_task(self._renew_forever(), name="ckptd-member-lease")
        log.info("member %s at %s holds a lease of %gs in the store", self.member_id,
                 self.self_url, self.ttl)

    async def _identify(self) -> str | None:
        try:
            store_id, self._created = await asyncio.wait_for(store_identity(self.store),
                                                             IDENTIFY_WITHIN)
        except (CkptdError, OSError, TimeoutError) as exc:
            log.warning("cannot read the store's id %s (%s): clients cannot check that "
                        "the replicas they are given serve this store", STORE_ID_KEY,
                        str(exc) or type(exc).__name__)
            return None
        log.info("store id %s (%s)", store_id, STORE_ID_KEY)
        return store_id

    async def stop(self) -> None:
        """Stops renewing and gives the lease back, so clients move on at once."""
        for task in (self._task, self._peer_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._peer_task = None
        if self.mode == "lease" and self._lease is not None:
            # Only the lease it wrote: a successor with the same id (a restarted pod)
            # may have taken it over, and its lease must stay.
            with contextlib.suppress(CkptdError, OSError):
                await self.store.compare_and_delete(self.key, self._lease)
            self._lease = None

    async def renew(self) -> None:
        """Writes this replica's lease, valid for ``ttl`` from now."""
        new = Member(self.member_id, self.self_url, time.time() + self.ttl).to_json()
        for _ in range(5):
            current = self._lease
            if await self.store.compare_and_swap(self.key, current, new):
                self._lease = self._wrote = new
                self._cached = None
                return
            # Someone else wrote it (a restarted replica of the same id): take it over.
            try:
                self._lease = await self.store.get(self.key)
            except NotFound:
                self._lease = None
            if current is not None and current == self._wrote and self._lease is not None:
                self._say_collision(self._lease)
        log.warning("could not renew lease %s: it keeps changing", self.key)

    def _say_collision(self, theirs: bytes) -> None:
        """Another live process rewrote the lease this one holds: two replicas share
        its id, and the store lists one of them."""
        if self._collided:
            return
        self._collided = True
        try:
            where = Member.parse(theirs, self.key).url
        except CkptdError:
            where = "?"
        log.error("member id %s is another live replica's too (%s rewrote lease %s while this "
                  "one held it): only one of them is listed; give each replica its own "
                  "CKPTD_MEMBER_ID, or leave it unset", self.member_id, where, self.key)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.renew()
            except (CkptdError, OSError) as exc:  # the store is down: try again soon
                log.warning("renewing lease %s failed: %s", self.key, exc)

    async def members(self) -> list[Member]:
        """The live members, ordered by id."""
        if self.mode == "single":
            return [Member(self.member_id, self.self_url, 0.0)]
        if self.mode == "static":
            return [Member(default_member_id(u), u, 0.0) for u in self.peers]
        now = time.time()
        if self._cached is not None and now - self._cached[0] < min(1.0, self.ttl / 10):
            return self._cached[1]
        keys = [k async for k in self.store.list_prefix(MEMBERS_PREFIX)]
        found: list[Member] = []
        for key, data in zip(keys, await asyncio.gather(*(self._read(k) for k in keys)),
                             strict=True):
            if data is None:
                continue
            try:
                member = Member.parse(data, key)
            except CkptdError as exc:  # one damaged lease must not hide the others
                log.warning("%s", exc)
                continue
            if member.expires_at > now:
                found.append(member)
                self._say_skew(member, now)
        found.sort(key=lambda m: m.id)
        self._cached = (now, found)
        return found

    def _say_skew(self, member: Member, now: float) -> None:
        """Says once that a member's lease runs out further ahead than one lease from
        now: its clock runs ahead of this one's (leases are times on the writer's
        clock), so it is still listed that long after it stopped."""
        ahead = member.expires_at - now - self.ttl
        if ahead > SKEW_SAY_S and member.id != self.member_id and member.id not in self._skewed:
            self._skewed.add(member.id)
            log.warning("replica %s (%s) holds a lease until %.0f s from now, %.0f s past the "
                        "%g s lease: its clock runs about that much ahead of this one's, and "
                        "it stays listed that long after it stops; keep the replicas' clocks "
                        "in step (NTP)", member.id, member.url, member.expires_at - now,
                        ahead, self.ttl)

    async def _read(self, key: str) -> bytes | None:
        try:
            return await self.store.get(key)
        except NotFound:
            return None  # expired and removed between the listing and the read

    def _heard(self, url: str) -> str | None:
        """The store id ``url`` serves, as far as this replica knows."""
        if url == self.self_url:
            return self.store_id
        return self.peer_stores.heard.get(url) if self.peer_stores is not None else None

    async def view(self) -> ClusterView:
        members = await self.members()
        return ClusterView(
            mode=self.mode,
            self_url=self.self_url,
            store_id=self.store_id,
            members=[
                ClusterMember(id=m.id, url=m.url,
                              expires_at=m.expires_at if self.mode == "lease" else None,
                              store_id=self._heard(m.url))
                for m in members
            ],
        )
