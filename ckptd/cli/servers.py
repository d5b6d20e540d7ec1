"""The servers a command is pointed at, asked once before its first call.

A command's calls are retried (a busy or restarting server gets a second chance),
so a server that takes connections and never answers (a process stopped with
``kill -STOP``, wedged, or swapped out) kept ``ckptd ls`` silent for minutes: a
timed-out read retried five times. And in a list of URLs one wrong entry (another
program on that port, a server that refuses the token, one that serves a store of
its own) was taken for the job's damage or named as the whole list; servers given
each other as ``--peers`` but over different stores listed an empty table.

So each URL a command is given is asked ``GET /v1/cluster`` once, all at once, with
a short wait (``CKPTD_ANSWER_WITHIN``, 10 s): a ckptd server answers at once, however
busy (``status`` waits as long for its calls).
A mistake is the command's error, naming the entry (two replicas whose store ids
differ: both); a silent server is one too when
no other answers; a silent or unreachable replica in a list is passed over (a
warning), as routing would. Only the CLI asks: a training process keeps its retries
(a slow answer there must not fail a save).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from ckptd.errors import CkptdError, InvalidRequest, Unauthorized, Unavailable

log = logging.getLogger(__name__)

__all__ = ["check_servers", "reached"]


_checked: set[tuple[str, str | None]] = set()


@dataclass(frozen=True, slots=True)
class _Heard:
    url: str
    mode: str | None = None  # the cluster mode it answered with ("?": a ckptd without it)
    store_id: str | None = None  # the id of the store it serves (None: not said)
    mistake: CkptdError | None = None
    silent: bool = False  # took the connection, sent nothing
    unreached: bool = False  # refused it, or no route there
    unresolved: str | None = None  # what to say of a host name that does not resolve


def check_servers(url: str, token: str | None, within: float | None = None) -> str:
    """``url`` when each server it names answers as a ckptd server that takes
    ``token``, and (several) as a replica of the others over the same store; not a
    server's URL: as it
    is. Raises the error that names the entry at fault. Once per URL and token in
    a process."""
    if not url.startswith(("http://", "https://")) or (url, token) in _checked:
        return url
    if within is None:
        from ckptd import knobs

        within = knobs.answer_within()
    from ckptd.cluster import parse_urls

    heard = _ask_all(parse_urls(url), token, within)
    for h in heard:
        if h.mistake is not None:
            raise h.mistake
    answering = [h for h in heard if h.mode is not None]
    silent = [h.url for h in heard if h.silent]
    if not answering:
        if silent:
            raise Unavailable(_silence(silent, within), url=url)
        names = [h for h in heard if h.unresolved]
        if names:  # said now: the command's own tries would retry for seconds
            raise Unavailable(f"cannot reach {names[0].url}: {names[0].unresolved}", url=url,
                              unresolved=True)
        return url  # (refused: the command's own tries say so, as they always have)
    if len(heard) > 1:
        alone = [h.url for h in answering if h.mode == "single"]
        if alone:
            raise InvalidRequest(
                f"{alone[0]} serves alone (started without --peers or --member-leases): it "
                f"is no replica of the other servers in --url; give one server's URL, or "
                "start the replicas with --peers URL,URL,... (docs/replicas.md)")
        from ckptd.cluster import store_mismatch

        mismatch = store_mismatch((h.url, h.store_id) for h in answering)
        if mismatch is not None:
            raise InvalidRequest(mismatch)
        _pass_over(url, [(h.url, h.silent) for h in heard if h.silent or h.unreached], within)
    _checked.add((url, token))
    return url


def _ask_all(urls: list[str], token: str | None, within: float) -> list[_Heard]:
    """Each URL asked at once, on daemon threads: Ctrl-C ends the command at once, not
    after a silent server's wait (a pool's threads are joined at exit)."""
    heard: list[_Heard | None] = [None] * len(urls)

    def ask(i: int) -> None:
        try:
            heard[i] = _ask(urls[i], token, within)
        except CkptdError as exc:  # (a bad CKPTD_* setting, a CA bundle not read)
            heard[i] = _Heard(urls[i], mistake=exc)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True, name="ckptd-ask")
               for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)
    return [h if h is not None else _Heard(u, unreached=True) for u, h in zip(urls, heard,
                                                                                strict=True)]


def reached(url: str, token: str | None) -> str:
    """A reading command's ``--url`` as a store's URL (``existing_store``), its servers
    asked: called before the command's event loop, so that Ctrl-C ends the wait."""
    from ckptd.cli.mistakes import existing_store

    return check_servers(existing_store(url), token)


def _silence(urls: list[str], within: float) -> str:
    which = " and ".join(urls)
    verb = "does" if len(urls) == 1 else "do"
    return (f"{which} {verb} not answer: the connection was taken and nothing came back "
            f"in {within:g} s (a server stopped with kill -STOP, wedged, or swapping); "
            "check its process and log, or name another server with --url")


def _pass_over(url: str, gone: list[tuple[str, bool]], within: float) -> None:
    """The replicas of ``url`` that did not answer (silent: took the connection and
    said nothing; else refused it): their calls go to the others."""
    if not gone:
        return
    from ckptd.client.routing import members_for

    members = members_for(url)
    for u, silent in gone:
        members.mark_down(u, TimeoutError(f"no answer in {within:g} s") if silent
                          else ConnectionRefusedError(f"{u} refused the connection"))


def _ask(url: str, token: str | None, within: float) -> _Heard:
    from ckptd.client import calls
    from ckptd.client.calls import not_a_server
    from ckptd.client.transport_http import ask_once, tls_trouble, unresolved

    try:
        resp = ask_once(url, calls.cluster(), token, within)
    except httpx.ConnectTimeout:
        return _Heard(url, unreached=True)
    except httpx.TimeoutException:
        return _Heard(url, silent=True)
    except httpx.RequestError as exc:
        trouble = tls_trouble(url, exc)
        if trouble is not None:
            return _Heard(url, mistake=trouble)
        return _Heard(url, unreached=True, unresolved=unresolved(url, exc))
    body = _json(resp)
    if resp.status_code == 200 and isinstance(body, dict) and isinstance(body.get("mode"), str):
        store_id = body.get("store_id")
        return _Heard(url, mode=body["mode"],
                      store_id=store_id if isinstance(store_id, str) else None)
    if not (isinstance(body, dict) and isinstance(body.get("code"), str)):
        return _Heard(url, mistake=not_a_server(resp))  # another program's answer
    if resp.status_code == 401:
        message = body.get("message") or "unauthorized"
        said = "refused the token" if token else "needs a token and none was given"
        return _Heard(url, mistake=Unauthorized(f"{url} {said}: {message}"))
    # A ckptd that answers with its own error (one without this route, a token that may
    # not list replicas but may do what the command asks): the command's calls decide.
    return _Heard(url, mode="?")


def _json(resp: httpx.Response) -> Any:
    try:
        return json.loads(resp.content)
    except ValueError:
        return None
