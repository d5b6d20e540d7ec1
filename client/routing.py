"""Routing over ckptd replicas, under every HTTP client of the training process.

A chunk's calls (its missing-query, upload, download) go to the chunk's home
replica, and a job's calls (heartbeats, restore plans, snapshot requests,
manifests, commits) to the job's home, both by rendezvous hashing over the members
(``ckptd.cluster``), so that the soft state that must meet (dedup claims, a job's
heartbeats and plans) meets in one process. The members are the URLs the client was
given, then what ``GET /v1/cluster`` lists. A replica that refuses connections is
marked down and its calls go to the next replica in the key's rendezvous order at
once; so does one that does not answer a connection within ``CKPTD_CONNECT_TIMEOUT``
(3 s; its host vanished), whatever the request timeout. A request lost mid-way
(the replica died, or only dropped a pooled connection: a busy live server does)
is not a down mark by itself: the caller's retry connects afresh, and a dead
replica refuses that connection. A connection TCP gave up on (its host vanished
mid-request: the transport's keepalive and TCP_USER_TIMEOUT, ``transport_http``)
is one. So is a membership read that fails, but one whose connection was only
dropped is asked once more first. Down marks last three refreshes, then the
replica is tried again.

The first membership read asks every replica (given, then listed) and compares the
ids of their stores: over different stores a save's chunks went to one and its
manifest to the other (``MissingChunks``). The store most of the URLs given serve
is the client's for good: a replica on another (a mistyped ``--store``) is left out
with one warning and asked again at each refresh; an answer that says a member serves
another store has each asked at once. URLs given with no such majority (two, one on
each store) make every call raise ``InvalidRequest`` naming two, until they agree.

A replica that hangs (its process stopped or wedged: the kernel still takes the
connection and the bytes) neither refuses nor times out a connection. A request
that waits on one for ``CKPTD_SUSPECT_AFTER`` seconds (5) before its answer starts
has the replica's ``/healthz`` asked, on a connection of its own: a live replica
answers that within 2 s, however busy and whatever its store does; one that does
not answer within ``PROBE_TIMEOUT`` (5 s) is marked down, and every request still waiting on
it is given up and retried at the next replica: a hang costs about ten seconds, not
a request timeout (60 s) per request. The same holds while an answer's body streams
(``routing_body.py``): a read of it that waits ``CKPTD_SUSPECT_AFTER`` has the
replica probed, and a mark ends the read with ``ReplicaDown``, which the caller
retries at the next replica as any body lost mid-way. A membership read that times
out only turns new calls away, as do down marks by other evidence of a busy replica.

It is an httpx transport under both faces of ``transport.py``: the async
``HttpTransport`` and the sync ``SyncTransport`` (heartbeats, the health agent,
the CLI; ``routing_sync.py``) route alike without knowing about replicas. Only the
async face probes: the sync one's calls are small answers read whole (a CLI command
asks each replica once first, ``ckptd/cli/servers.py``). Chunk reads over the
transport's raw sockets (``PeerClient``, ``HttpTransport.chunk_reads``) do not pass
through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any
from urllib.parse import urlparse

import httpx

from ckptd import knobs
from ckptd.cluster import (
    STORE_ID_KEY,
    chunk_key,
    job_key,
    majority_store,
    parse_urls,
    rank_members,
    route_key,
    store_mismatch,
)
from ckptd.errors import InvalidRequest

from .routing_body import ReplicaDown, WatchedBody, settle

log = logging.getLogger(__name__)

__all__ = [
    "ROUTE_HEADER",
    "AsyncRouting",
    "Members",
    "ReplicaDown",
    "members_for",
]

#: a request's routing key when its path has none (a batch of chunk ids)
ROUTE_HEADER = "X-Ckptd-Route"
CLUSTER_PATH = "/v1/cluster"
HEALTH_PATH = "/healthz"
# Connection failures: the request never reached the replica, so any call may go on.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout)
# What TCP says of a connection whose host vanished mid-request (TCP_USER_TIMEOUT or
# keepalive gave up; a router found no way there): unlike a dropped connection (a
# reset, an early end), which a busy live replica gives too, it marks the replica down.
_GONE_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
                          errno.EHOSTDOWN})


def host_gone(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) says the server's host is not there."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _GONE_ERRNOS:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def dropped(exc: httpx.TransportError) -> bool:
    """True when the replica closed the connection under a request without an answer
    and nothing says its host is gone: what a live server does to a kept-alive
    connection it closes as idle just as the request arrives. A fresh connection gets
    the answer."""
    return (isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError)
            and not host_gone(exc))


_LEARN_TIMEOUT = {"connect": 2.0, "read": 5.0, "write": 5.0, "pool": 5.0}
# Seconds a probed replica has to answer ``/healthz`` (which waits at most 2 s on its
# store) before it counts as hung: whatever CKPTD_SUSPECT_AFTER says, a live replica
# on a loaded host is not judged in less.
PROBE_TIMEOUT = 5.0


class Members:
    """The replicas one client routes over, shared by its HTTP clients (thread-safe)."""

    def __init__(self, seeds: Iterable[str], refresh_s: float | None = None) -> None:
        self.seeds = list(seeds)
        self.urls = list(self.seeds)
        self.refresh_s = knobs.cluster_refresh() if refresh_s is None else refresh_s
        # url -> when it was marked down (monotonic); a mark lasts DOWN_REFRESHES
        # refreshes, then the replica is tried again (a restarted one comes back).
        self._down: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_refresh = 0.0  # monotonic; 0: never learned
        self.down_for = 3 * self.refresh_s
        self.refreshes = 0
        self.failovers = 0
        # url -> what to call when it is marked down (requests under way to it)
        self._watchers: dict[str, set[Callable[[], None]]] = {}
        # Two URLs given over different stores, in a line: every call raises it.
        self.mismatch: str | None = None
        self.store_id: str | None = None  # the store of the URLs given (None: not said)
        # url -> the other store's id: replicas listed but left out of the routing
        self.left_out: dict[str, str] = {}
        # A membership answer said a member serves another store: ask each now.
        self.recheck = False

    def order(self, key: str | None) -> list[str]:
        """Where a call with routing ``key`` goes, best first: the key's rendezvous
        order with down replicas last (the same as leaving them out), or for calls
        without a key the members as listed, down ones last."""
        now = time.monotonic()
        with self._lock:
            urls = list(self.urls)
            down = {u for u, t in self._down.items() if now - t < self.down_for}
        ranked = rank_members(key, urls) if key is not None else urls
        return [u for u in ranked if u not in down] + [u for u in ranked if u in down]

    def live(self) -> list[str]:
        """The members not marked down."""
        now = time.monotonic()
        with self._lock:
            return [u for u in self.urls
                    if now - self._down.get(u, -self.down_for) >= self.down_for]

    def homes(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """The keys grouped by their home (the first of ``order``), in one pass."""
        live = self.live() or list(self.urls)
        groups: dict[str, list[str]] = {}
        for key in keys:
            groups.setdefault(rank_members(key, live)[0], []).append(key)
        return groups

    def mark_down(self, url: str, exc: BaseException, *, abandon: bool = False) -> None:
        """New calls to ``url`` go to the next replica for a while. ``abandon``: the
        evidence says the replica is gone or hung (a refused connection, the stall
        watcher, an unanswered probe), so the requests waiting on it are given up too;
        a membership read that timed out only turns new calls away."""
        with self._lock:
            now = time.monotonic()
            fresh = now - self._down.get(url, -self.down_for) >= self.down_for
            if fresh:
                self._down[url] = now
                self.failovers += 1
                self._next_refresh = min(self._next_refresh, now)
            watchers = self._watchers.pop(url, set()) if abandon else set()
        for tell in watchers:
            tell()
        if fresh and len(self.urls) > 1:  # (with one replica there is no next one)
            log.warning("ckptd replica %s is unreachable (%s); its calls go to the next one",
                        url, type(exc).__name__)

    def watch(self, url: str, tell: Callable[[], None]) -> Callable[[], None]:
        """Calls ``tell`` once, from the thread that marks it, when ``url`` is next
        marked down with ``abandon``; returns what stops the watch."""
        with self._lock:
            self._watchers.setdefault(url, set()).add(tell)

        def stop() -> None:
            with self._lock:
                watching = self._watchers.get(url)
                if watching is not None:
                    watching.discard(tell)
                    if not watching:
                        del self._watchers[url]
        return stop

    def mark_gone(self, host: str, port: int) -> None:
        """A connection to ``host``:``port`` stopped getting any answer (the stall
        watcher, ``client/stall.py``): every member there is down."""
        for url in list(self.urls):
            u = urlparse(url)
            default = 443 if u.scheme == "https" else 80
            if (u.hostname or "").lower() == host.lower() and (u.port or default) == port:
                self.mark_down(url, TimeoutError(f"{host}:{port} stopped answering"),
                               abandon=True)

    def refresh_due(self) -> bool:
        # refresh_s <= 0: route over the URLs given only, never asking for more.
        return self.refresh_s > 0 and time.monotonic() >= self._next_refresh

    def learned(self) -> bool:
        return self.refresh_s <= 0 or self._next_refresh > 0.0

    def candidates(self) -> list[str]:
        """Whom to ask for the membership: live members, then the seeds."""
        return list(dict.fromkeys(self.order(None) + self.seeds))

    def identify_due(self) -> bool:
        """Whether a membership read asks each replica: the first, and while some disagree."""
        return not self.learned() or bool(self.mismatch or self.left_out or self.recheck)

    def to_identify(self, asked: Iterable[str], doc: Any | None) -> list[str]:
        """Replicas given or listed in ``doc`` not yet ``asked``, less those down."""
        live = set(self.live() or self.urls)
        urls = dict.fromkeys([*self.candidates(), *(_listed(doc) or [])])
        return [u for u in urls if u not in asked and (u in live or u not in self.urls)]

    def identified(self, answers: dict[str, Any]) -> None:
        """Compares the stores of the replicas' ``/v1/cluster`` answers (None: none):
        the URLs given with each other until most agree, then every one with theirs."""
        self.recheck = False
        ids = {u: _store_id(doc) for u, doc in answers.items()}
        if self.store_id is None:
            given = [(u, ids[u]) for u in self.seeds if u in ids]
            ours = majority_store(given)  # (a mismatch: raised by the call, not logged)
            self.mismatch = None if ours else store_mismatch(given)
            if self.mismatch is not None or ours is None:  # (no id given: compare all)
                self.mismatch = self.mismatch or store_mismatch(ids.items())
                return
            self.store_id = ours
        ours = self.store_id
        with self._lock:
            for url, sid in ids.items():
                if sid == ours and self.left_out.pop(url, None) is not None:
                    log.info("ckptd replica %s serves this client's store again", url)
                elif sid is not None and sid != ours and self.left_out.get(url) != sid:
                    self.left_out[url] = sid
                    log.warning("ckptd replica %s serves another store (store id %s) than %s "
                                "given (store id %s, %s): this client leaves it out of its "
                                "routing. Fix that replica's --store (every replica of a "
                                "cluster serves one store), or give the URL of a replica on "
                                "the right store (docs/replicas.md)", url, sid[:8],
                                ", ".join(self.seeds), ours[:8], STORE_ID_KEY)
            self.urls = [u for u in self.urls if u not in self.left_out] or list(self.seeds)

    def check(self) -> None:
        """Raises ``InvalidRequest`` while the replicas serve different stores."""
        mismatch = self.mismatch
        if mismatch is not None:
            raise InvalidRequest(mismatch, replicas=self.urls)

    def update(self, doc: Any | None) -> None:
        """Takes a ``/v1/cluster`` answer (None: nobody answered; keep what is known)."""
        urls = _listed(doc)
        with self._lock:
            self.refreshes += 1
            self._next_refresh = time.monotonic() + self.refresh_s
            if doc is None:
                return
            if urls is not None:
                urls = [u for u in urls if u not in self.left_out] or list(self.seeds)
                # (a member restarted on another store, as the one answering heard it)
                self.recheck = self.store_id is not None and any(
                    u in urls and sid not in (None, self.store_id)
                    for u, sid in _member_ids(doc))
            if urls is not None and urls != self.urls:
                log.info("ckptd replicas: %s", ", ".join(urls))
                self.urls = urls


def _listed(doc: Any | None) -> list[str] | None:
    """The members a ``/v1/cluster`` answer lists (None: it lists none, or is no such
    answer: a ``single`` server's, a refusal's)."""
    if isinstance(doc, dict) and doc.get("mode") in ("static", "lease"):
        try:
            return parse_urls(",".join(str(m["url"]) for m in doc.get("members", [])))
        except (KeyError, TypeError, ValueError):
            return None
    return None


def _member_ids(doc: Any) -> list[tuple[str, str | None]]:
    """(URL, store id as the answering replica heard it) of each member listed."""
    members = doc.get("members", []) if isinstance(doc, dict) else []
    return [(str(m.get("url")).rstrip("/"), _store_id(m)) for m in members if isinstance(m, dict)]


def _store_id(doc: Any | None) -> str | None:
    store_id = doc.get("store_id") if isinstance(doc, dict) else None
    return store_id if isinstance(store_id, str) else None


_SHARED: dict[tuple[tuple[str, ...], float], Members] = {}
_SHARED_LOCK = threading.Lock()


def members_for(url: str) -> Members:
    """The one ``Members`` of this process for a URL list (``http://a,http://b``)."""
    key = (tuple(parse_urls(url)), knobs.cluster_refresh())
    with _SHARED_LOCK:
        members = _SHARED.get(key)
        if members is None:
            members = _SHARED[key] = Members(*key)
        return members


def _key(request: httpx.Request) -> str | None:
    key = request.headers.get(ROUTE_HEADER) or route_key(request.url.path)
    if key is None and request.url.path == "/v1/overview" and "job" in request.url.params:
        key = job_key(request.url.params["job"])  # one job's soft state: at its home
    return key


def _order(members: Members, request: httpx.Request) -> list[str]:
    """Where ``request`` goes: its key's order; a call without a key to the member
    it names (a merge asking each replica in turn), else to the first live one."""
    key = _key(request)
    order = members.order(key)
    if key is None:
        named = f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"
        if named in members.live():
            order = [named] + [u for u in order if u != named]
    return order


def _to(request: httpx.Request, base: str) -> httpx.Request:
    target = httpx.URL(base)
    request.url = request.url.copy_with(scheme=target.scheme, host=target.host,
                                        port=target.port)
    request.headers["Host"] = target.netloc.decode("ascii")
    return request


def _learn_request(base: str, request: httpx.Request) -> httpx.Request:
    headers = {}
    if "authorization" in request.headers:
        headers["Authorization"] = request.headers["authorization"]
    return httpx.Request("GET", base + CLUSTER_PATH, headers=headers,
                         extensions={"timeout": _LEARN_TIMEOUT})


def _cluster_doc(status: int, body: bytes) -> Any:
    """The ``/v1/cluster`` answer, or {} (a server without it, a refusal): routing
    then stays on the URLs given."""
    if status != 200:
        return {}
    try:
        return json.loads(body)
    except ValueError:
        return {}


class AsyncRouting(httpx.AsyncBaseTransport):
    """Routes each request of an ``httpx.AsyncClient`` to its home replica."""

    def __init__(self, members: Members, inner: httpx.AsyncBaseTransport,
                 probes: httpx.AsyncBaseTransport | None = None) -> None:
        self.members = members
        self.inner = inner
        #: connections of their own for probes of a replica that keeps a request
        #: waiting (``_send``; None: never probed)
        self.probes = probes
        self._learning: asyncio.Lock | None = None
        self._probing: dict[str, asyncio.Future[None]] = {}  # (kept alive while they run)

    async def learn(self, request: httpx.Request) -> None:
        """Re-reads the membership when it is due (the first call waits for it)."""
        if not self.members.refresh_due():
            return
        if self._learning is None:
            self._learning = asyncio.Lock()
        if self._learning.locked() and self.members.learned():
            return  # someone is at it; route by what is known meanwhile
        async with self._learning:
            if not self.members.refresh_due():
                return
            for _ in range(2):  # (again at once when the answer says to recheck)
                doc: Any | None = None
                if self.members.identify_due():
                    doc = await self._ask_every(request)
                else:
                    for base in self.members.candidates():
                        if (doc := await self._ask(base, request)) is not None:
                            break
                self.members.update(doc)
                if not self.members.recheck:
                    break

    async def _ask(self, base: str, request: httpx.Request) -> Any | None:
        """``base``'s ``/v1/cluster`` answer ({}: it answered none), None when it
        could not be reached (it is marked down). A connection dropped under the read
        (``dropped``) is asked once more before that."""
        for again in (True, False):
            try:
                resp = await self.inner.handle_async_request(_learn_request(base, request))
                body = await resp.aread()
                await resp.aclose()
            except httpx.TransportError as exc:
                if again and dropped(exc):
                    continue
                self.members.mark_down(base, exc)
                return None
            return _cluster_doc(resp.status_code, body)
        return None  # (not reached)

    async def _ask_every(self, request: httpx.Request) -> Any | None:
        """Every replica asked at once, then those the first answer lists: that
        answer is the membership, and all are compared (``Members.identified``)."""
        answers: dict[str, Any] = {}
        doc: Any | None = None
        for _ in range(2):
            bases = self.members.to_identify(answers, doc)
            docs = await asyncio.gather(*(self._ask(b, request) for b in bases))
            answers.update(zip(bases, docs, strict=True))
            if doc is None:
                doc = next((d for d in docs if d is not None), None)
        self.members.identified(answers)
        return doc

    async def by_home(self, ids: list[str], headers: httpx.Headers) -> list[list[str]]:
        """Chunk ids grouped by their home replica (one group when there are none)."""
        if not ids:
            return [ids]
        await self.learn(httpx.Request("GET", self.members.seeds[0], headers=headers))
        groups = self.members.homes(chunk_key(cid) for cid in ids)
        return [[key.removeprefix("chunk:") for key in keys] for keys in groups.values()]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await self.learn(request)
        self.members.check()
        order = _order(self.members, request)
        for i, base in enumerate(order):
            try:
                return await self._send(request, base)
            except _UNSENT as exc:
                # (refused: gone; not taken in time: maybe a full backlog)
                self.members.mark_down(base, exc, abandon=isinstance(exc, httpx.ConnectError))
                if i == len(order) - 1:
                    raise
            except httpx.TransportError as exc:  # maybe sent: the caller's retry goes on
                if host_gone(exc):
                    self.members.mark_down(base, exc, abandon=True)
                raise
        raise httpx.ConnectError("no ckptd replica to send to", request=request)

    async def _send(self, request: httpx.Request, base: str) -> httpx.Response:
        """``request`` sent to ``base``, given up (``ReplicaDown``, which the caller's
        retry takes to the next replica) when ``base`` is marked down as gone or hung
        before its answer starts, and each read of its body likewise while it streams
        (``WatchedBody``): a replica that hangs holds a request until a probe
        (``_probe``) or the stall watcher notices, not for a whole request timeout."""
        suspect_after = knobs.suspect_after()
        if len(self.members.urls) < 2 or self.probes is None or suspect_after <= 0:
            return await self.inner.handle_async_request(_to(request, base))
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def tell() -> None:
            with contextlib.suppress(RuntimeError):  # (its loop closed: nothing waits)
                loop.call_soon_threadsafe(settle, gone)

        stop = self.members.watch(base, tell)
        send = asyncio.ensure_future(self.inner.handle_async_request(_to(request, base)))
        try:
            await asyncio.wait((send, gone), timeout=suspect_after,
                               return_when=asyncio.FIRST_COMPLETED)
            if not (send.done() or gone.done()):  # slow: is the replica there at all?
                self._probe(base)
                await asyncio.wait((send, gone), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # (the caller cancelled: so is the request, and waited for)
            await _given_up(send)
            raise
        finally:
            stop()
            gone.cancel()
        if not send.done():
            await _given_up(send)
            raise ReplicaDown(f"ckptd replica {base} was marked down while it had this "
                              "request", request=request)
        resp = send.result()
        if isinstance(resp.stream, httpx.AsyncByteStream):  # its body: watched alike
            resp.stream = WatchedBody(resp.stream, request, base, watch=self.members.watch,
                                      probe=self._probe, suspect_after=suspect_after)
        return resp

    @contextlib.asynccontextmanager
    async def watching(self, base: str, on_down: Callable[[], None]) -> AsyncIterator[None]:
        """While the block runs (a request to ``base`` that this transport does not
        carry: chunk reads over raw sockets), ``base`` is probed every
        ``CKPTD_SUSPECT_AFTER`` seconds, and ``on_down`` is called (from the thread
        that marks it) when it is marked down as gone or hung."""
        suspect_after = knobs.suspect_after()
        if len(self.members.urls) < 2 or self.probes is None or suspect_after <= 0:
            yield
            return

        async def suspect() -> None:
            while True:
                await asyncio.sleep(suspect_after)
                self._probe(base)

        stop = self.members.watch(base, on_down)
        timer = asyncio.ensure_future(suspect())
        try:
            yield
        finally:
            stop()
            timer.cancel()

    def _probe(self, base: str) -> None:
        """Asks ``base``'s ``/healthz``, in the background, once at a time per replica,
        on the probes' own connections (a pool full of slow requests does not hold
        it up): any answer says it is there (``/healthz`` waits at most 2 s on a store
        that hangs); none within ``PROBE_TIMEOUT`` marks it down, and every request
        waiting on it is given up."""
        if base in self._probing or self.probes is None:
            return
        probes = self.probes
        limits = dict.fromkeys(("connect", "read", "write", "pool"), PROBE_TIMEOUT)

        async def probe() -> None:
            try:
                resp = await probes.handle_async_request(httpx.Request(
                    "GET", base + HEALTH_PATH, extensions={"timeout": limits}))
                await resp.aread()
                await resp.aclose()
            except httpx.PoolTimeout:
                pass  # (this side's probes are all busy: says nothing of the replica)
            except httpx.TransportError as exc:
                self.members.mark_down(base, exc, abandon=True)
            finally:
                self._probing.pop(base, None)

        self._probing[base] = asyncio.ensure_future(probe())

    async def aclose(self) -> None:
        probing = list(self._probing.values())
        for probe in probing:
            probe.cancel()
        if probing:
            await asyncio.wait(probing)
        if self.probes is not None:
            await self.probes.aclose()
        await self.inner.aclose()


async def _given_up(send: asyncio.Future[httpx.Response]) -> None:
    """Cancels a request under way and waits until it ended (it may be reading the
    caller's buffers); an answer that came meanwhile is closed (its connection goes
    back to the pool). A cancellation of the caller's own meanwhile propagates."""
    send.cancel()
    await asyncio.wait((send,))
    if not send.cancelled() and send.exception() is None:
        await send.result().aclose()


def merge_overviews(views: list[dict[str, Any]], urls: list[str]) -> dict[str, Any]:
    """One ``/v1/overview`` from every replica's: each job as its home replica (by
    the same rendezvous order) sees it, since only the home holds its soft state."""
    by_url = dict(zip(urls, views, strict=True))
    merged = dict(views[0])
    names = sorted({job["job"] for view in views for job in view.get("jobs", [])})
    jobs = []
    for name in names:
        for url in rank_members(job_key(name), urls):
            found = [j for j in by_url[url].get("jobs", []) if j["job"] == name]
            if found:
                jobs.append(found[0])
                break
    merged["jobs"] = jobs
    return merged
