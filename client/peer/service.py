"""``PeerService``: one rank's presence, serving its pool to peers and
heartbeating, and saying goodbye at exit."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from typing import Any

from .server import PeerIndex, PeerServer

log = logging.getLogger(__name__)


class PeerService:
    """What a ``Checkpointer`` runs for failover: the peer chunk server (when
    ``serve``) and the heartbeat thread (``heartbeat``, for an HTTP server), kept in
    agreement: what the server serves is what heartbeats call ``held_step``.

    A live pool's chunks are published once their step committed (``committed``,
    or ``pending`` to publish when a heartbeat sees the commit); ``staging`` is
    called before a save overwrites the pool (the live index stops being valid
    then anyway, through the seqlock; this also stops advertising it). Chunks of a
    re-adopted pool (``adopted``, verified against a committed manifest) are served
    until this process first stages: its index's ``valid`` is that pool's
    generation, which the first stage bumps."""

    def __init__(self, server: PeerServer | None, heartbeat: Any | None) -> None:
        self.server = server
        self.heartbeat = heartbeat
        self._adopted: Any | None = None  # keeps the adopted pool's views mapped
        self._live = False
        self._lock = threading.Lock()
        if heartbeat is not None and server is not None:
            heartbeat.set_peer_url(server.url)
            # The job's peer token comes with heartbeat replies: never the client's
            # server token (a peer would hold the key to the whole server).
            heartbeat.on_peer_token = server.set_token

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def start(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start()
            # A process that ends without close() still leaves cleanly (a killed one
            # cannot, and shows dead): the hook holds no reference to this service.
            atexit.register(_goodbye_at_exit, weakref.ref(self))

    def note_step(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.note_step(step)

    def staging(self) -> None:
        """A save is about to stage into the pool: what is served now stops being
        valid (the seqlock would refuse it anyway); stop advertising it."""
        with self._lock:
            self._live = False
            old, self._adopted = self._adopted, None
            if self.server is not None:
                self.server.clear()
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        if self.heartbeat is not None:
            self.heartbeat.set_held_step(None, wake=False)

    def committed(self, index: PeerIndex) -> None:
        """The live pool holds committed step ``index.step``: serve it (unless a
        newer save already began overwriting it)."""
        if not index.valid():
            return
        with self._lock:
            if self.server is not None:
                self.server.publish(index)
            self._live = True
            old, self._adopted = self._adopted, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        if self.heartbeat is not None and index.step is not None:
            self.heartbeat.set_held_step(index.step)

    def pending(self, index: PeerIndex) -> None:
        """The live pool holds step ``index.step``, not committed yet: publish it
        once a heartbeat sees it committed (still valid then)."""
        step = index.step
        if self.heartbeat is None or step is None:
            return

        def publish(_: int) -> None:
            if index.valid():
                self.committed(index)

        self.heartbeat.hold_when_committed(step, publish)

    def adopted(self, index: PeerIndex, keep: Any, *, beat: bool = True) -> None:
        """Verified chunks of a re-adopted pool (``keep`` holds their mapping):
        served unless the live pool already serves a committed step."""
        with self._lock:
            if self._live:
                with contextlib.suppress(Exception):
                    keep.close()
                return
            old, self._adopted = self._adopted, keep
            if self.server is not None:
                self.server.publish(index)
        if old is not None and old is not keep:
            with contextlib.suppress(Exception):
                old.close()
        if self.heartbeat is not None and index.step is not None:
            self.heartbeat.set_held_step(index.step, wake=not beat)
            if beat:
                self.heartbeat.beat_now()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(goodbye=True)
        if self.server is not None:
            self.server.close()
        with self._lock:
            old, self._adopted = self._adopted, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()


def _goodbye_at_exit(ref: weakref.ref[PeerService]) -> None:
    service = ref()
    if service is not None and service.heartbeat is not None:
        service.heartbeat.stop(timeout=1.0, goodbye=True)
