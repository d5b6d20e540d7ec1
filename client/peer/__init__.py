"""Peer chunk serving: each training process serves, by chunk id over HTTP, the
chunks of its staging pool that belong to a committed step, so a replacement rank
on another node can restore from its data-parallel replicas instead of the store.

Server
    ``PeerServer`` is a small HTTP/1.1 server: one daemon thread admits
    connections and reads their request heads (a selector: a half-open connection
    holds no worker, and at its cap the server closes the longest half-open one to
    admit a new one), a fixed pool of daemon threads answers whole requests, with
    read deadlines (``peer.http``; no event loop to share with training, no thread
    per connection). ``GET /v1/chunks/{id}`` answers the chunk's raw bytes, ``GET
    /v1/peer`` what the peer holds. It serves only what ``publish`` handed it: a
    ``PeerIndex`` of chunk id -> bytes in the pool, built from a committed
    manifest (or from chunks of a re-adopted pool that were verified against one),
    with a ``valid`` check. For the live pool that check is the staging seqlock:
    the generation must be the one the index was built at, before and after the
    bytes go out, so a chunk whose buffer a new ``save`` is overwriting is
    refused with 409 (the client then tries another source) and never kept torn.
    To a client that reads trailers (``PeerClient``) a chunk is sent straight
    from the pool (``sendmsg`` of the view: the kernel's copy is the only one),
    chunked, with the seqlock's verdict after the body (``X-Ckptd-Valid``); to
    others it is copied out into a reused scratch buffer and checked first. The
    number of requests served at once is bounded (``CKPTD_PEER_CONCURRENCY``;
    others wait a moment, then get 503), and every request must carry the job's
    peer token (``Authorization: Bearer``), which the server hands to the job's
    ranks, so a peer neither starves training nor serves another job.

Client
    ``PeerClient`` fetches a chunk straight into the caller's buffer over
    kept-alive blocking sockets (``recv_into`` with ``MSG_WAITALL``: no
    intermediate copy, one system call per chunk; httpx reached 0.4 times its
    throughput on loopback, ``http.client`` used twice its CPU), and raises typed errors:
    ``ChunkNotFound`` (404), ``Conflict`` (409: being overwritten), ``Unavailable``
    (refused, reset, 503, short body), ``ChunkSizeMismatch``. It does not hash:
    the restore engine verifies every chunk against its id on arrival.

The package: ``server`` (``PeerServer``, ``PeerIndex``), ``address`` (where it
listens and what it advertises: every interface, and the address other hosts
reach), ``http`` (its bounded HTTP/1.1), ``client`` (``PeerClient``) and
``service`` (``PeerService``: one rank's presence, serving and heartbeating).
"""

from .address import PeerAddress, peer_address, route_address
from .client import PeerClient, wait_listening
from .server import EMPTY_INDEX, PeerIndex, PeerServer, PeerStats
from .service import PeerService

__all__ = [
    "EMPTY_INDEX",
    "PeerAddress",
    "PeerClient",
    "PeerIndex",
    "PeerServer",
    "PeerService",
    "PeerStats",
    "peer_address",
    "route_address",
    "wait_listening",
]
