"""Live peers as a scrub repair source, without lending anyone the server's token.

A corrupt chunk is asked for only from ranks whose own committed manifest (of the
step their pool holds) names it: a rank never learns a chunk id its job does not
already know, so no tenant hears of another job's chunks. Each is asked with its
own job's peer token (what its peers already present to it), never the server's
token, at the peer URL its heartbeat registered: the heartbeat's source address
or an address in ``CKPTD_PEER_NETWORKS`` (``server/peering.py``). Nothing else
of the environment applies (no proxy from ``HTTP_PROXY``, no redirects), and the
answer is read up to one chunk's size, within ``CKPTD_SCRUB_PEER_TIMEOUT`` in all
(a tenant's listener that sends a byte now and then must not hold the scrub of
every job), and then checked by its hash (scrub)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx

from ckptd import knobs
from ckptd.errors import CkptdError
from ckptd.lifecycle.scrub import ChunkSource
from ckptd.server.auth import peer_token
from ckptd.server.registry import Registry, StoreViews

log = logging.getLogger(__name__)

# Ranks asked for one corrupt chunk at most, and how long each may take.
PEERS_ASKED = 4
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0
FETCH_DEADLINE_S = 30.0  # one chunk, all of it (CKPTD_SCRUB_PEER_TIMEOUT)


async def holders(registry: Registry, views: StoreViews, cid: str
                  ) -> AsyncIterator[tuple[str, int, str]]:
    """(job, rank, peer URL) of each live rank whose held step's own manifest names
    ``cid``, the healthiest first within a job."""
    for job in registry.jobs():
        _, ranks = registry.ranks(job)
        for view in ranks:
            if view.state in ("dead", "left") or not view.peer_url or view.held_step is None:
                continue
            try:
                ids = await views.chunk_ids(job, view.held_step, view.rank)
            except CkptdError:  # not committed (yet), or damaged: it vouches for nothing
                continue
            if cid in ids:
                yield job, view.rank, view.peer_url


async def fetch(http: httpx.AsyncClient, url: str, cid: str, token: str,
                deadline_s: float = FETCH_DEADLINE_S) -> bytes | None:
    """The chunk's bytes as the peer at ``url`` sends them within ``deadline_s``, or
    None."""
    try:
        async with asyncio.timeout(deadline_s), http.stream(
                "GET", f"{url.rstrip('/')}/v1/chunks/{cid}",
                headers={"Authorization": f"Bearer {token}"}) as r:
            if r.status_code != 200:
                return None
            body = bytearray()
            async for part in r.aiter_bytes():
                body += part
                if len(body) > knobs.MAX_CHUNK_SIZE:  # no chunk is larger: not one
                    return None
            return bytes(body)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        log.info("scrub: peer %s did not give chunk %s: %s", url, cid, exc)
        return None
    except TimeoutError:
        log.info("scrub: peer %s did not give chunk %s within %.0f s", url, cid, deadline_s)
        return None


def peer_source(registry: Registry, views: StoreViews, secret: bytes,
                deadline_s: float = FETCH_DEADLINE_S) -> ChunkSource:
    """Asks up to ``PEERS_ASKED`` ranks that hold ``cid``, each for ``deadline_s`` at
    most (see the module)."""

    async def get(cid: str) -> bytes | None:
        asked = 0
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False,
                                     follow_redirects=False) as http:
            async for job, rank, url in holders(registry, views, cid):
                data = await fetch(http, url, cid, peer_token(secret, job), deadline_s)
                if data is not None:
                    log.info("scrub: rank %d of %s sent chunk %s", rank, job, cid)
                    return data
                asked += 1
                if asked >= PEERS_ASKED:
                    break
        return None

    return get
