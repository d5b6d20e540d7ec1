"""Routing over ckptd replicas under the sync ``httpx.Client`` (``routing.py``'s twin).

Heartbeats, the health agent and the command line call through ``SyncTransport``;
its requests are small answers read whole, so this face neither probes a replica
that keeps a request waiting nor watches bodies: it routes each request to its key's
home, marks a replica that refuses connections (or whose host vanished) down, and
goes on to the next in the rendezvous order.

Its first membership read asks every replica at once, each on a thread of its own
(the async face gathers them alike): one that hangs costs the read's timeout once,
not once per replica asked before the live ones.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .routing import (
    _UNSENT,
    Members,
    _cluster_doc,
    _learn_request,
    _order,
    _to,
    dropped,
    host_gone,
)

__all__ = ["SyncRouting"]


class SyncRouting(httpx.BaseTransport):
    """Routes each request of an ``httpx.Client`` (heartbeats, the health agent)."""

    def __init__(self, members: Members, inner: httpx.BaseTransport | None = None) -> None:
        self.members = members
        self.inner = inner if inner is not None else httpx.HTTPTransport()
        self._learning = threading.Lock()

    def learn(self, request: httpx.Request) -> None:
        """Re-reads the membership when it is due (the first call waits for it)."""
        if not self.members.refresh_due():
            return
        if not self._learning.acquire(blocking=not self.members.learned()):
            return  # someone is at it; route by what is known meanwhile
        try:
            if not self.members.refresh_due():
                return
            for _ in range(2):  # (again at once when the answer says to recheck)
                doc: Any | None = None
                if self.members.identify_due():
                    doc = self._ask_every(request)
                else:
                    for base in self.members.candidates():
                        if (doc := self._ask(base, request)) is not None:
                            break
                self.members.update(doc)
                if not self.members.recheck:
                    break
        finally:
            self._learning.release()

    def _ask_every(self, request: httpx.Request) -> Any | None:
        """Every replica asked at once, then those the first answer lists: that
        answer is the membership, and all are compared (``Members.identified``)."""
        answers: dict[str, Any] = {}
        doc: Any | None = None
        for _ in range(2):
            bases = self.members.to_identify(answers, doc)
            if not bases:
                break
            with ThreadPoolExecutor(len(bases), thread_name_prefix="ckptd-learn") as pool:
                docs = list(pool.map(lambda base: self._ask(base, request), bases))
            answers.update(zip(bases, docs, strict=True))
            if doc is None:
                doc = next((d for d in docs if d is not None), None)
        self.members.identified(answers)
        return doc

    def _ask(self, base: str, request: httpx.Request) -> Any | None:
        """``base``'s ``/v1/cluster`` answer ({}: it answered none), None when it
        could not be reached (it is marked down). A connection dropped under the read
        (``dropped``) is asked once more before that."""
        for again in (True, False):
            try:
                resp = self.inner.handle_request(_learn_request(base, request))
                body = resp.read()
                resp.close()
            except httpx.TransportError as exc:
                if again and dropped(exc):
                    continue
                self.members.mark_down(base, exc)
                return None
            return _cluster_doc(resp.status_code, body)
        return None  # (not reached)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.learn(request)
        self.members.check()
        order = _order(self.members, request)
        for i, base in enumerate(order):
            try:
                return self.inner.handle_request(_to(request, base))
            except _UNSENT as exc:
                self.members.mark_down(base, exc)
                if i == len(order) - 1:
                    raise
            except httpx.TransportError as exc:  # maybe sent: the caller's retry goes on
                if host_gone(exc):
                    self.members.mark_down(base, exc)
                raise
        raise httpx.ConnectError("no ckptd replica to send to", request=request)

    def close(self) -> None:
        self.inner.close()
