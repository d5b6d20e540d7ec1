"""The object store read directly: over an S3-compatible store the server's restore
plan carries a presigned GET URL per chunk of this rank's manifest, and chunks are
read from the object store itself (``bytes_from["object"]``), each verified as from
any source, so that the server carries no restore bytes (issue 21, item 3).

When the object store will not give them (the URLs expired or were refused: a
clock skew, a bucket policy, an endpoint this host cannot reach), direct reads stop
for the rest of the restore and every chunk goes to the next source, the server
(``StoreSource``). ``CKPTD_DIRECT_READS=0`` turns them off on this side,
``CKPTD_PRESIGNED_READS=false`` on the server's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import ssl
import time
from collections.abc import Mapping, Sequence

from ckptd import knobs
from ckptd.errors import Unavailable

from ..peer import PeerClient
from .sources import ChunkProblem, Source, verify_hash

log = logging.getLogger(__name__)

# A URL is not used this close to its expiry (at most this share of its lifetime):
# a read that starts just before may be refused in flight.
EXPIRY_MARGIN_S = 30.0
EXPIRY_MARGIN_SHARE = 0.1

# Refusals that say no URL of this plan will do (expired, not allowed, bad
# signature; and any redirect): direct reads stop. A 5xx, or bytes of the wrong
# length, try the next chunk.
_REFUSED = frozenset({400, 401, 403})
_GONE = frozenset({"unreachable", "timeout"})
# Connections the object store dropped in a row before direct reads stop: one is a
# load balancer's or a busy store's, several with no read between them a path that
# does not hold.
DROPS_ALLOWED = 3


class ObjectStoreSource(Source):
    """Chunks read from the object store through the restore plan's presigned URLs."""

    tier = "object"  # (its bytes are counted as the object store's, apart from the server's)

    def __init__(self, reads: Mapping[str, str], expire_in: float | None,
                 *, timeout: float | None = None, threads: int | None = None,
                 planned_at: float | None = None) -> None:
        self.reads = dict(reads)
        start = time.monotonic() if planned_at is None else planned_at
        self.until: float | None = None
        if expire_in is not None:
            margin = min(EXPIRY_MARGIN_S, expire_in * EXPIRY_MARGIN_SHARE)
            self.until = start + expire_in - margin
        self.stopped: str | None = None  # why direct reads stopped (None: they go on)
        self.drops = 0  # connections the object store dropped since its last good read
        timeout = knobs.request_timeout() if timeout is None else timeout
        # No token: a URL is its own authorization, and nothing of ckptd's goes to it.
        self.client = PeerClient(None, timeout=timeout, idle_per_peer=16, label="object store",
                                 tls=object_store_tls(os.environ.get("AWS_CA_BUNDLE") or None))
        workers = threads or max(2, min(16, knobs.restore_concurrency()))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers,
                                                           thread_name_prefix="ckptd-object")

    @classmethod
    def of(cls, reads: Mapping[str, str], expire_in: float | None, planned_at: float | None,
           ) -> ObjectStoreSource | None:
        """The source for a plan's URLs, or None: none given, or turned off here."""
        if not reads or not knobs.direct_reads():
            return None
        return cls(reads, expire_in, planned_at=planned_at)

    def holders(self, cid: str) -> Sequence[str]:
        if self.stopped is not None or cid not in self.reads:
            return ()
        if self.until is not None and time.monotonic() > self.until:
            self._stop("the plan's presigned URLs are about to expire")
            return ()
        return ("object store",)

    def _read_and_hash(self, cid: str, dest: memoryview) -> str:
        self.client.get_into(self.reads[cid], dest, cid)
        return verify_hash(dest)  # in this thread, while the bytes are in cache

    async def fetch_into(self, holder: str, cid: str, dest: memoryview) -> str | None:
        if self.stopped is not None:
            raise Unavailable(f"direct reads stopped: {self.stopped}", reason="dropped")
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._pool, self._read_and_hash, cid, dest)
        try:
            got = await asyncio.shield(work)
            self.drops = 0
            return got
        except asyncio.CancelledError:
            # A deadline passed: no thread may go on receiving into ``dest`` after the
            # caller returned (as PeerSource).
            self.client.abort()
            await asyncio.wait([work])
            raise
        except Unavailable as exc:
            status = exc.detail.get("status")
            if status in _REFUSED:
                self._stop(f"the object store refused a presigned URL ({exc})")
            elif isinstance(status, int) and 300 <= status < 400:
                # (not followed: a URL signs one host) Every URL of the plan names that
                # host: the server's S3 endpoint or region is not the bucket's.
                self._stop(f"the object store redirects presigned URLs elsewhere ({exc}): "
                           "the server's S3 endpoint or region (?endpoint=, ?region=) is "
                           "not the bucket's")
            elif exc.detail.get("reason") in _GONE:
                self._stop(f"the object store cannot be reached ({exc})")
            elif exc.detail.get("reason") == "disconnected":
                self.drops += 1
                if self.drops >= DROPS_ALLOWED:
                    self._stop(f"the object store dropped {self.drops} connections in a "
                               f"row ({exc})")
            raise

    def _stop(self, why: str) -> None:
        if self.stopped is None:
            log.warning("reading chunks from the object store directly stopped: %s; the "
                        "rest come through the server", why)
            self.stopped = why

    def outcome(self, holder: str, problem: ChunkProblem | None) -> None:
        """Bytes that do not verify are the object's own (the server would send the
        same ones): the engine records them and asks the next source; nothing stops."""

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


@functools.lru_cache(maxsize=4)
def object_store_tls(ca_bundle: str | None) -> ssl.SSLContext:
    """How an https:// object store's certificate is checked: against
    ``AWS_CA_BUNDLE`` when set (botocore's own variable, so the server and the
    ranks trust the same CA), else the default trust store. Not ckptd's
    ``CKPTD_CA_BUNDLE``: that is the ckptd server's CA, not the object store's."""
    if ca_bundle:
        return ssl.create_default_context(cafile=ca_bundle)
    import httpx

    return httpx.create_ssl_context()
