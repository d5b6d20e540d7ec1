"""What every HTTP face of a ckptd server shares, and the synchronous one.

The async ``HttpTransport`` (``transport.py``: saves, restores) and the sync
``SyncTransport`` (heartbeats, the health agent, the CLI) run the same ``Call``s
(``calls.py``) with the same session (replicas and routing, bearer token, the
``X-Ckptd-Job`` header, timeouts, TLS) and the same ``Attempts``: which answers
return, which are retried with exponential backoff, and which typed error any
other answer is. Only the waiting differs (``await`` or block).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlparse

import httpx

from ckptd import knobs
from ckptd.api import (
    ClusterView,
    EventList,
    ForgetResult,
    GcResult,
    GcRunBody,
    GcStatus,
    Health,
    HeartbeatReply,
    JobList,
    Overview,
    RollbackReply,
    ScrubResult,
    SnapshotReply,
    SpaceResult,
)
from ckptd.errors import (
    CheckpointNotFound,
    CkptdError,
    InvalidRequest,
    StoreCorrupt,
    StoreError,
    StoreFull,
    Timeout,
    Unavailable,
    UnsupportedStoredFormat,
    from_json,
)
from ckptd.format import CommitRecord, check_job

from . import calls
from .calls import Call, answer_excerpt, not_a_server
from .routing import Members, members_for, merge_overviews
from .routing_sync import SyncRouting
from .stall import guard

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["CA_BUNDLE_ENV", "SyncTransport", "ask_once", "tls_trouble", "tls_verify",
           "unresolved"]


def bearer(token: str | None) -> str | None:
    """``token`` as it is sent: without the whitespace around it (a secret file's last
    newline: a Kubernetes secret mounted as a file has one). One with a character no
    token has inside it is refused in a line that does not repeat it: in a header it
    was an "illegal header value" quoting the whole token, retried as a network
    failure ("start the server")."""
    token = (token or "").strip()
    odd = next((i for i, c in enumerate(token) if not "!" <= c <= "~"), None)
    if odd is not None:
        raise InvalidRequest(
            f"the token (token= or CKPTD_TOKEN) holds a character no token has, at "
            f"position {odd + 1} of {len(token)} (a space, a control or a non-ASCII "
            "character): copy it again from where it was made", setting="CKPTD_TOKEN")
    return token or None


class Session:
    """Where one HTTP face goes and how: its replicas, headers, retries, timeout."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        job: str | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        backoff: float | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        # Several replicas (``http://a:8470,http://b:8470``): requests are routed to
        # their home replica (routing.py). ``url`` names them all, so that every face
        # given it routes over the same replicas.
        self.members: Members = members_for(url)
        self.url = ",".join(self.members.seeds)
        self.retries = knobs.retries() if retries is None else retries
        self.backoff = knobs.retry_backoff() if backoff is None else backoff
        self.timeout = knobs.request_timeout() if timeout is None else timeout
        # A replica whose host vanished answers no SYN: its calls go to the next
        # replica after this, not after the request timeout (routing.py).
        self.connect_timeout = knobs.connect_timeout()
        token = bearer(token)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        if job is not None:
            # Chunk routes name no job: a scoped token says which of its jobs acts.
            self.headers["X-Ckptd-Job"] = check_job(job)
        self.verify = tls_verify(ca_bundle)

    def timeouts(self) -> httpx.Timeout:
        """The client's timeouts: ``timeout`` per read and write, ``connect_timeout``."""
        return calls.request_timeout(self.timeout, self.connect_timeout)

    def arguments(self, call: Call[Any]) -> dict[str, Any]:
        """``call``'s request arguments, its own timeout bounded by ``connect_timeout``
        for connecting."""
        return call.arguments(self.connect_timeout)

    def socket_options(self) -> list[tuple[int, int, int]]:
        """Options of every connection to a server: a host that vanishes mid-request
        (its link down: no reset, no answer) fails the request within
        ``CKPTD_STALL_TIMEOUT`` (20 s), not at the request timeout. Data left
        unacknowledged that long (TCP_USER_TIMEOUT), or a connection silent that
        long while a request waits (keepalive probes from ``connect_timeout`` idle
        on), ends the connection; the call is retried and routing moves on. Not
        shorter: Linux also ends a connection whose peer kept its window shut that
        long, and a busy live server does, for up to its ``CKPTD_INGEST_WAIT`` (10 s),
        before it admits an upload; the stall watcher (``stall.py``) cuts a connection
        whose host stopped answering within seconds. Linux options, where the
        platform has them."""
        idle = max(1, round(self.connect_timeout))
        stall = max(knobs.stall_timeout(), 2 * self.connect_timeout)
        opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3),
                            ("TCP_USER_TIMEOUT", round(1000 * stall))):
            opt = getattr(socket, name, None)
            if opt is not None and value > 0:
                opts.append((socket.IPPROTO_TCP, opt, value))
        return opts


class Attempts:
    """The tries of one call: when to wait, which answers return, which are retried,
    and the typed error when none got through."""

    def __init__(self, session: Session, call: Call[Any]) -> None:
        self.url = session.url
        self.call = call
        self.attempts = session.retries + 1
        self.backoff = session.backoff
        self.attempt = 0
        self.last: BaseException | None = None

    def waits(self) -> Iterator[float]:
        """Seconds to wait before each try (0 before the first)."""
        delay = self.backoff
        for attempt in range(self.attempts):
            self.attempt = attempt
            if attempt:
                yield delay
                delay *= 2
            else:
                yield 0.0

    def _note(self, what: object) -> None:
        log.debug("%s %s %s (attempt %d/%d)", self.call.method, self.call.path, what,
                  self.attempt + 1, self.attempts)

    def timed_out(self, exc: httpx.TimeoutException) -> None:
        self.last = exc
        self._note("timed out")

    def failed(self, exc: httpx.RequestError, trouble: CkptdError | None) -> None:
        """The request did not get through; ``trouble``: what ``tls_trouble`` says."""
        if trouble is not None:  # retrying cannot help a TLS mismatch
            raise trouble from None
        self.last = exc
        self._note(f"failed: {exc}")

    def answered(self, resp: httpx.Response) -> bool:
        """True for an answer in ``ok``; False to try again; else raises its error."""
        if resp.status_code in self.call.ok:
            return True
        error = http_error(resp)
        if resp.status_code >= 500 and not isinstance(
                error, StoreFull | StoreCorrupt | UnsupportedStoredFormat):
            # (a full or damaged store, or one a newer ckptd wrote, answers the same)
            self.last = error
            self._note(f"answered {resp.status_code}")
            return False
        raise error

    def give_up(self) -> NoReturn:
        """Raises the typed error of the last try; httpx's and httpcore's exceptions
        under it add nothing the message does not say (logged at debug level)."""
        method, last = self.call.method, self.last
        # (a list of replicas: the path, then the list, not the path glued onto it)
        where = (f"{self.url}{self.call.path}" if "," not in self.url
                 else f"{self.call.path} at {self.url}")
        if last is not None and not isinstance(last, CkptdError):
            log.debug("%s %s: the last try's error", method, where, exc_info=last)
        if isinstance(last, httpx.TimeoutException):
            raise Timeout(f"{method} {where} timed out {self.attempts} times "
                          f"({type(last).__name__})", url=self.url) from None
        if isinstance(last, CkptdError) and not isinstance(last, _UntypedServerError):
            raise last
        tries = f" ({self.attempts} attempts)" if self.attempts > 1 else ""
        name = unresolved(self.url, last) if isinstance(last, httpx.ConnectError) else None
        if name is not None:  # no server to start there: the URL's host is wrong
            raise Unavailable(f"cannot reach {self.url}{tries}: {name}", url=self.url,
                              unresolved=True) from None
        if self.attempts == 1 and isinstance(last, httpx.RequestError):
            raise Unavailable(f"cannot reach {self.url}: {last}", url=self.url,
                              unreached=True) from None
        if isinstance(last, httpx.ConnectError):
            raise Unavailable(f"cannot reach {self.url} ({self.attempts} attempts): {last}",
                              url=self.url, unreached=True) from None
        raise Unavailable(f"{method} {where} failed after {self.attempts} attempts: {last}",
                          url=self.url) from None


class _UntypedServerError(CkptdError):
    """A 5xx answer without a ckptd error body (a proxy, a crash): retried, then
    reported as ``Unavailable``."""


def http_error(resp: httpx.Response) -> CkptdError:
    """The typed error of an answer that is not a success."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        error = from_json(body, resp.status_code)
        if error.code == StoreError.code:  # (not its kin: store_full, ... say what ckptd found)
            # The server's own words name its store's endpoint: said as this caller's,
            # "nothing answered at http://minio:9000" sent users to check the wrong host.
            url = resp.request.url
            detail = error.detail
            error = StoreError(f"the ckptd server at {url.scheme}://"
                               f"{url.netloc.decode('ascii')} could not use its store: "
                               f"{error.message}")
            error.detail = dict(detail)  # (as from_json: a key "message" must not clash)
        return error
    text = answer_excerpt(resp)
    if resp.status_code >= 500:
        return _UntypedServerError(f"HTTP {resp.status_code}: {text}")
    # Every answer of a ckptd server that is not a success carries a typed error body:
    # one without is another program on that port (a wrong --url).
    return not_a_server(resp)


class SyncTransport:
    """A ckptd server, synchronously: the calls of the heartbeat thread, the health
    agent's worker and the CLI, routed and retried as the async transport's."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        job: str | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        backoff: float | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        self.session = Session(url, token, job=job, timeout=timeout, retries=retries,
                               backoff=backoff, ca_bundle=ca_bundle)
        self.url = self.session.url
        self.members = self.session.members
        # httpx ignores a client's verify= once it is given a transport: the inner one
        # carries the TLS settings.
        self._client = httpx.Client(
            base_url=self.members.seeds[0],
            headers=self.session.headers,
            timeout=self.session.timeouts(),
            transport=SyncRouting(self.members, guard(httpx.HTTPTransport(
                verify=self.session.verify, socket_options=self.session.socket_options()),
                self.members.mark_gone)),
        )

    def __repr__(self) -> str:
        return f"<SyncTransport {self.url}>"

    def run(self, call: Call[T]) -> T:
        """One call, with retries; its answer read with the core's model."""
        tries = Attempts(self.session, call)
        for wait in tries.waits():
            if wait:
                time.sleep(wait)
            try:
                resp = self._client.request(call.method, call.path,
                                            **self.session.arguments(call))
            except httpx.TimeoutException as exc:
                tries.timed_out(exc)
                continue
            except httpx.RequestError as exc:
                tries.failed(exc, tls_trouble(self.url, exc))
                continue
            if tries.answered(resp):
                return call.read(resp)
        tries.give_up()

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SyncTransport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the calls (calls.py says what each sends and reads) ------------------------------

    def healthz(self) -> Health:
        return self.run(calls.healthz())

    def cluster(self) -> ClusterView:
        return self.run(calls.cluster())

    def heartbeat(self, job: str, rank: int, body: dict[str, Any]) -> HeartbeatReply:
        return self.run(calls.heartbeat(job, rank, body))

    def goodbye(self, job: str, rank: int, timeout: float) -> None:
        self.run(calls.goodbye(job, rank, timeout))

    def read_commit(self, job: str, step: int) -> CommitRecord:
        return self.run(calls.read_commit(job, step))

    def latest(self, job: str) -> int | None:
        try:
            return self.run(calls.latest(job)).step
        except CheckpointNotFound:
            return None

    def jobs(self) -> JobList:
        return self.run(calls.jobs())

    def rollback(self, job: str) -> RollbackReply:
        return self.run(calls.rollback(job))

    def set_rollback(self, job: str, step: int, reason: str,
                     from_epoch: int | None = None) -> RollbackReply:
        return self.run(calls.set_rollback(job, step, reason, from_epoch))

    def clear_rollback(self, job: str) -> RollbackReply:
        return self.run(calls.clear_rollback(job))

    def snapshot_request(self, job: str, rank: int, reason: str,
                         step_time_s: float | None = None) -> SnapshotReply:
        return self.run(calls.snapshot_request(job, rank, reason, step_time_s))

    def events(self, job: str) -> EventList:
        return self.run(calls.events(job))

    def overview(self, params: dict[str, Any]) -> Overview:
        """``GET /v1/overview``; over several replicas, each job as its home sees it
        (only the home holds a job's soft state)."""
        if "job" in params:
            return self.run(calls.overview(params))
        self.healthz()  # learns the replicas (GET /v1/cluster) first
        urls = self.members.live()
        if len(urls) < 2:
            return self.run(calls.overview(params))
        views = [self.run(calls.overview(params, replica=u)).model_dump(mode="json")
                 for u in urls]
        return Overview.model_validate(merge_overviews(views, urls), strict=False,
                                       extra=calls.ANSWER_EXTRA)

    def forget(self, job: str, dry_run: bool, keep_last: int | None,
               step: int | None = None) -> ForgetResult:
        return self.run(calls.forget(job, dry_run, keep_last, step))

    def gc(self, dry_run: bool, grace: float | None) -> GcResult:
        return self.run(calls.gc(dry_run, grace))

    def start_gc(self, grace: float | None) -> GcRunBody:
        return self.run(calls.start_gc(grace))

    def gc_status(self) -> GcStatus:
        return self.run(calls.gc_status())

    def scrub(self, budget_bytes: int | None) -> ScrubResult:
        return self.run(calls.scrub(budget_bytes))

    def tag(self, job: str, name: str, step: int) -> dict[str, int]:
        return self.run(calls.tag(job, name, step))

    def untag(self, job: str, name: str) -> dict[str, int]:
        return self.run(calls.untag(job, name))

    def space(self) -> SpaceResult:
        return self.run(calls.space())


def ask_once(url: str, call: Call[Any], token: str | None, within: float) -> httpx.Response:
    """``call`` at ``url`` itself, once: not routed to another replica, not retried,
    answered within ``within`` seconds (connected within ``CKPTD_CONNECT_TIMEOUT``).
    The CLI's check of each server it is given (``ckptd/cli/servers.py``); httpx's
    errors are the caller's to read."""
    token = bearer(token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = calls.request_timeout(within, knobs.connect_timeout())
    with httpx.Client(base_url=url, verify=tls_verify(), headers=headers,
                      timeout=timeout) as client:
        return client.request(call.method, call.path, **call.arguments())


# -- TLS ------------------------------------------------------------------------------

# A PEM file of the CA(s) that signed an https:// server's certificate.
CA_BUNDLE_ENV = "CKPTD_CA_BUNDLE"


def tls_verify(ca_bundle: str | None = None) -> ssl.SSLContext:
    """What an https:// server's certificate is checked against: ``ca_bundle``,
    else ``CKPTD_CA_BUNDLE``, else the default trust store. One context per
    bundle for the process: building one reads the whole bundle (tens to hundreds
    of ms), and every client, plain-HTTP ones included, would build its own."""
    path = ca_bundle or os.environ.get(CA_BUNDLE_ENV) or None
    try:
        return _tls_context(path)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"CA bundle {path} ({CA_BUNDLE_ENV}) cannot be read: {exc}") from None


@functools.lru_cache(maxsize=8)
def _tls_context(path: str | None) -> ssl.SSLContext:
    if path is None:
        return httpx.create_ssl_context()  # what verify=True builds (certifi, SSL_CERT_*)
    return ssl.create_default_context(cafile=path)


def unresolved(url: str, exc: BaseException) -> str | None:
    """What to say when a connection to ``url`` failed because its host name does
    not resolve (no such name: not a lookup that may pass on a later try); None for
    any other failure."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, socket.gaierror):
        cause = cause.__cause__ or cause.__context__
    if cause is None or cause.errno not in _NO_SUCH_NAME:
        return None
    host = urlparse(url).hostname if "," not in url else None  # (several: not known which)
    which = f"the host name {host!r}" if host else "a host name in it"
    return (f"{which} does not resolve ({cause.strerror}): check the host in the URL "
            "(--url, url= or CKPTD_URL)")


# No such name (EAI_NONAME, and EAI_NODATA where the platform has it: a name
# without an address). EAI_AGAIN, a lookup that failed for now, is retried.
_NO_SUCH_NAME = {socket.EAI_NONAME} | ({socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA")
                                       else set())


def tls_trouble(url: str, exc: BaseException) -> CkptdError | None:
    """The error that says what to do when a connection failed for a TLS reason (an
    https:// URL of a plain-HTTP server, an untrusted certificate; an http:// URL of
    a TLS server); None for any other failure. Blocking: it may try one request of
    the other kind to tell them apart."""
    parsed = urlparse(url)
    if parsed.hostname is None:
        return None
    if parsed.scheme == "http":  # (one server's URL: of a list, not known which)
        return None if "," in url else _plain_to_tls(parsed.hostname, parsed.port or 80, exc)
    if parsed.scheme != "https":
        return None
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    host, port = parsed.hostname, parsed.port or 443
    if isinstance(cause, ssl.SSLCertVerificationError):
        return InvalidRequest(
            f"{url}: the server's certificate is not trusted ({cause.verify_message}); give "
            f"the CA that signed it: {CA_BUNDLE_ENV}=/path/ca.pem (or ca_bundle=)"
        )
    if _speaks_plain_http(host, port):
        return InvalidRequest(
            f"{host}:{port} speaks plain HTTP, not TLS: use http://{host}:{port}, or put TLS "
            "in front of it (ckptd serve --tls-cert FILE --tls-key FILE, or a TLS-terminating "
            "reverse proxy; docs/operations.md, 'TLS')"
        )
    return None


def _plain_to_tls(host: str, port: int, exc: BaseException) -> CkptdError | None:
    """An http:// request that a server ended without an answer: a TLS server does
    so (it reads the request as a handshake that fails)."""
    if not isinstance(exc, httpx.RemoteProtocolError) or not _speaks_tls(host, port):
        return None
    return InvalidRequest(f"{host}:{port} speaks TLS: use https://{host}:{port}")


# (host, port) -> (monotonic time, whether it answered a TLS handshake): a plain
# server also ends a kept-alive connection just as a request goes out, and each
# such ending must not cost a handshake's connection (asked again after a minute).
_TLS_ASKED: dict[tuple[str, int], tuple[float, bool]] = {}


def _speaks_tls(host: str, port: int) -> bool:
    asked = _TLS_ASKED.get((host, port))
    if asked is not None and time.monotonic() - asked[0] < 60.0:
        return asked[1]
    answered = _handshakes(host, port)
    _TLS_ASKED[(host, port)] = (time.monotonic(), answered)
    return answered


def _handshakes(host: str, port: int) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # (only whether it answers a handshake)
    try:
        with socket.create_connection((host, port), timeout=2.0) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return True
    except (OSError, ValueError):
        return False


def _speaks_plain_http(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0) as sock:
            sock.sendall(b"HEAD /healthz HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
            return sock.recv(5) == b"HTTP/"
    except OSError:
        return False
