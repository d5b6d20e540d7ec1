"""A new checkpointer's first word with its server: one that cannot be reached, or
refuses the checkpointer's token, is said at construction, within seconds, in one
typed error that names the URL and what to do (not a logged heartbeat failure
and, 17 s later, the first call's traceback of three chained exceptions)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from ckptd.cluster import loopback_host
from ckptd.errors import CkptdError, Forbidden, Unauthorized, Unavailable

from . import calls
from .transport import HttpTransport
from .transport_http import http_error, tls_trouble

log = logging.getLogger(__name__)

# Seconds of refused connections after which a new checkpointer says what it waits for.
SAY_AFTER = 2.0


async def reach(transport: HttpTransport, job: str, within: float) -> str | None:
    """Asks the server for ``job``'s rollback state (a read the job's token may make)
    and, once it answered, whether the token may write the job (``may_write``): the
    server's refusal of a write when it may only read, else None. Raises at once
    what retrying cannot mend (a refused token, a program that is not a ckptd
    server, a TLS mismatch), and ``Unavailable`` when no replica took a connection
    for ``within`` seconds (refused: tried again meanwhile, for a server starting or
    restarting, and said in a warning after ``SAY_AFTER`` seconds) or one connect
    timeout (nothing answered: a host that is not there). A server that took the connection but
    answers slowly, or answers 5xx, is there: the checkpointer goes on, and its
    calls say what is wrong."""
    started = time.monotonic()
    deadline = started + within
    connect = transport.session.connect_timeout
    call = calls.rollback(job)
    delay = 0.1
    said = False
    while True:
        left = max(0.5, deadline - time.monotonic())
        try:
            resp = await transport.send_once(call, httpx.Timeout(max(left, connect),
                                                                 connect=connect))
        except httpx.ConnectTimeout as exc:
            _debug(transport, exc)
            raise Unavailable(
                f"no ckptd server answers at {transport.url}: nothing took a connection in "
                f"{connect:g} s (CKPTD_CONNECT_TIMEOUT). Check the host and port in url= or "
                "CKPTD_URL, and that the network lets this host reach it",
                url=transport.url) from None
        except httpx.TimeoutException as exc:  # connected; the answer is slow: it is there
            _debug(transport, exc)
            return None
        except httpx.RequestError as exc:
            _debug(transport, exc)
            trouble = await asyncio.to_thread(tls_trouble, transport.url, exc)
            if trouble is not None:
                raise trouble from None
            listed = _listed_member(transport, exc)
            if time.monotonic() + delay >= deadline:
                if listed is not None:
                    raise Unavailable(
                        f"cannot reach the ckptd replica {listed} ({_reason(exc)}, for "
                        f"{within:g} s), which {transport.url} lists as a member: each "
                        "replica's advertised URL (ckptd serve --advertise-url, "
                        "CKPTD_ADVERTISE_URL) must resolve and be reachable from this host",
                        url=listed, listed_by=transport.url) from None
                raise Unavailable(
                    f"cannot reach the ckptd server at {transport.url} ({_reason(exc)}, for "
                    f"{within:g} s): start it (ckptd serve), or point url= or CKPTD_URL at "
                    "where it runs (CKPTD_SERVER_WAIT gives a server that starts beside "
                    "training, or restarts, longer)" + _where_hint(transport.url, exc),
                    url=transport.url) from None
            if not said and time.monotonic() - started >= SAY_AFTER:
                said = True  # a restart is waited for; a mistake is said now all the same
                log.warning(
                    "cannot reach the ckptd %s (%s): waiting up to %.0f s more "
                    "(CKPTD_SERVER_WAIT), for a server that is restarting. If it is not "
                    "running, start it (ckptd serve), or point url= or CKPTD_URL at where it "
                    "runs", f"replica {listed} (listed by {transport.url})" if listed
                    else f"server at {transport.url}", _reason(exc),
                    max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.5)
            continue
        if resp.status_code == 200:
            return await may_write(transport)
        if resp.status_code >= 500:  # there, in trouble: its calls will say what
            log.info("%s answered %d to a new checkpointer: %s", transport.url,
                     resp.status_code, http_error(resp))
            return None
        raise _refusal(transport, resp, job) from None


async def may_write(transport: HttpTransport) -> str | None:
    """The server's refusal (its message) when this token may read the transport's job
    but not write it (a read token: an eval job's), else None. Asked with a
    missing-chunks question of no ids, which needs write on the job the request acts
    for (``X-Ckptd-Job``, this checkpointer's) and changes nothing: no chunk is
    leased, and no GC note is written for no ids (docs/SECURITY.md). Any answer but
    403, or none in time, is left to the saves to say (None)."""
    connect = transport.session.connect_timeout
    try:
        resp = await transport.send_once(calls.missing_chunks([]),
                                         httpx.Timeout(connect + 5.0, connect=connect))
    except httpx.RequestError as exc:
        _debug(transport, exc)
        return None
    if resp.status_code != 403:
        return None
    refusal = http_error(resp)  # (ckptd's own refusal only: a proxy's 403 is no answer)
    if not isinstance(refusal, Forbidden) or refusal.detail.get("needs") != "write":
        return None
    return refusal.message


def _refusal(transport: HttpTransport, resp: httpx.Response, job: str) -> CkptdError:
    return token_refusal(http_error(resp), transport.url,
                         "Authorization" in transport.session.headers, job)


def token_refusal(error: CkptdError, url: str, given: bool, job: str,
                  needs: str = "write") -> CkptdError:
    """A server's refusal of a token (``Unauthorized``, ``Forbidden``) said with its
    URL and how to pass one that it takes; any other error as it is."""
    if isinstance(error, Unauthorized):
        what = ("refused the token given" if given
                else "needs a token and none was given")
        return Unauthorized(
            f"the ckptd server at {url} {what} ({error.message}): pass the "
            "token it was started with, or one of job "
            f"{job!r} from `ckptd token create`, as token= or CKPTD_TOKEN", url=url)
    if isinstance(error, Forbidden):
        return Forbidden(
            f"the ckptd server at {url} refused the token given for job {job!r} "
            f"({error.message}): use a token whose scope covers job {job!r} with {needs} "
            "access (`ckptd token create`), as token= or CKPTD_TOKEN", url=url)
    return error


def _listed_member(transport: HttpTransport, exc: httpx.RequestError) -> str | None:
    """The replica ``exc``'s request went to when it is not one of the URLs given but
    one the membership (``GET /v1/cluster``) listed: its advertised URL, which this
    host cannot reach (a short name another namespace cannot resolve)."""
    try:
        url = exc.request.url
    except RuntimeError:  # (no request attached)
        return None
    tried = f"{url.scheme}://{url.netloc.decode('ascii')}"
    given = {_origin(httpx.URL(seed)) for seed in transport.members.seeds}
    return None if _origin(url) in given else tried


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    """A URL's scheme, host and port as httpx compares them (``HOST`` is ``host``)."""
    return url.scheme, url.host, url.port


def _where_hint(url: str, exc: httpx.RequestError) -> str:
    """The usual cause of a refused connection on several hosts: a loopback URL names
    this host (not the server's, on another node), and a server started with the
    default ``--host 127.0.0.1`` takes no connection from other hosts."""
    if _reason(exc) != "connection refused":
        return ""
    host = (httpx.URL(url).host or "").strip("[]")
    if loopback_host(host):
        return (f". {host} is this host: on a node other than the server's, give the "
                "server's own address")
    return (". A server started with the default --host 127.0.0.1 takes no connection "
            "from other hosts: start it with --host 0.0.0.0 (and a token)")


def _reason(exc: httpx.RequestError) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror.lower()
        cause = cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__


def _debug(transport: HttpTransport, exc: BaseException) -> None:
    log.debug("reaching %s: %s: %s", transport.url, type(exc).__name__, exc, exc_info=exc)
