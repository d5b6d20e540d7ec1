"""A static cluster's peers (``--peers``) that serve another store, said in the log.

A replica restarted with a mistyped ``--store`` makes a new, empty store and serves
it without a word; clients given another replica's URL leave it out of their
routing (``client/routing.py``), but nothing told the operator which replica was
wrong. So every ``CKPTD_PEER_CHECK_INTERVAL`` seconds a replica asks each of its
peers ``GET /v1/cluster`` (with its own ``CKPTD_TOKEN``, the one replicas share) and
compares the store id it answers with its own: a peer on another store is said in
one warning, once until it serves this store again. A peer that is down, refuses
the token or answers without an id is passed over (debug): nothing to compare.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from ckptd.cluster import STORE_ID_KEY

log = logging.getLogger(__name__)

__all__ = ["PeerStores", "ask_store_id", "peer_store_ids"]

# Seconds one peer has to answer (a replica answers /v1/cluster at once, however busy).
ASK_TIMEOUT = 5.0


class PeerStores:
    """Which of ``peers`` serve another store than ``store_id`` (``other``: url -> id)."""

    def __init__(self, self_url: str, peers: list[str], store_id: str, store: str, *,
                 token: str | None, created: bool) -> None:
        self.peers = [p for p in peers if p != self_url]
        self.store_id = store_id
        self.store = store  # (what this replica serves, as its log says at start)
        self.token = token
        self.created = created  # this replica wrote the store's id as it started
        self.other: dict[str, str] = {}  # peers on another store, said
        self.heard: dict[str, str] = {}  # peer -> the store id it last answered with

    async def check(self, client: httpx.AsyncClient) -> None:
        """Asks every peer at once and says what changed."""
        answers = await asyncio.gather(*(self._ask(client, p) for p in self.peers))
        heard = {p: sid for p, sid in zip(self.peers, answers, strict=True) if sid is not None}
        self.heard.update(heard)  # (shown in /v1/cluster: clients re-check a peer on another)
        ours = [p for p, sid in heard.items() if sid == self.store_id]
        for peer in ours:
            if self.other.pop(peer, None) is not None:
                log.info("replica %s in --peers serves this replica's store again "
                         "(store id %s)", peer, self.store_id[:8])
        theirs = {p: sid for p, sid in heard.items() if sid != self.store_id}
        # This replica is the odd one when two or more peers answer, every one of them
        # with one store id that is not this one's.
        odd = not ours and len(theirs) > 1 and len(set(theirs.values())) == 1
        for peer, sid in theirs.items():
            if self.other.get(peer) != sid:
                self.other[peer] = sid
                log.warning(self._say(peer, sid, "this" if odd else "that" if ours else ""))

    def _say(self, peer: str, theirs: str, wrong: str) -> str:
        if wrong == "this":
            which = ("every other replica that answered serves that store: check this "
                     "replica's --store first")
        elif wrong == "that":
            which = ("other replicas serve this one's: check that replica's --store, and "
                     "restart it with the one the others serve")
        else:
            which = "check which replica was given the wrong --store"
        if self.created and wrong != "that":
            which += " (this replica found no store id and made its store as it started)"
        return (f"replica {peer} in --peers serves another store than this replica's "
                f"{self.store} (store ids {theirs[:8]} and {self.store_id[:8]}, "
                f"{STORE_ID_KEY}): clients leave a replica on another store out of their "
                f"routing; {which} (docs/replicas.md)")

    async def _ask(self, client: httpx.AsyncClient, peer: str) -> str | None:
        return await ask_store_id(client, peer, self.token)

    async def run(self, every: float) -> None:
        """Checks now, then every ``every`` seconds, until cancelled."""
        async with peer_client(ASK_TIMEOUT) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    await self.check(client)
                await asyncio.sleep(every)


def peer_client(timeout: float) -> httpx.AsyncClient:
    """A client for peers: nothing of the environment (no proxy), no redirects."""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False,
                             follow_redirects=False)


async def ask_store_id(client: httpx.AsyncClient, peer: str, token: str | None) -> str | None:
    """The store id ``peer`` answers ``GET /v1/cluster`` with; None when it says none
    (down, a refused token, a server from before store ids)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = await client.get(f"{peer}/v1/cluster", headers=headers)
        doc: Any = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("asking peer %s for its store id: %s", peer, exc)
        return None
    theirs = doc.get("store_id") if isinstance(doc, dict) else None
    return theirs if isinstance(theirs, str) else None


async def peer_store_ids(peers: list[str], token: str | None,
                         timeout: float = 2.0) -> dict[str, str]:
    """The store id of each of ``peers`` that says one, all asked at once."""
    async with peer_client(timeout) as client:
        ids = await asyncio.gather(*(ask_store_id(client, p, token) for p in peers))
    return {p: sid for p, sid in zip(peers, ids, strict=True) if sid is not None}
