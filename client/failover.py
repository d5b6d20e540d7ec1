"""A checkpointer's part in failover: serving the pool's committed chunks to
peers, heartbeats to the server, and the training loop's health (probe,
coordinated snapshots, rollback). The wiring into ``peer``, ``heartbeat`` and
``health`` lives here, and only here."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ckptd import knobs

from .health.heartbeat import Heartbeat, HeartbeatReply
from .launch import heartbeat_launch
from .peer import PeerIndex, PeerServer, PeerService, peer_address
from .session import Session
from .transport import HttpTransport

if TYPE_CHECKING:
    from .health.agent import HealthAgent
    from .restore.sources import LocalPoolSource

log = logging.getLogger("ckptd.client.checkpointer")


def rank_gpus(local_rank: int | None, environ: Mapping[str, str] | None = None
              ) -> list[int | str] | None:
    """The GPU the health probe watches for this rank: its ``local_rank``'s device as
    NVML names it, without touching CUDA (a context made here would cost the rank
    GPU memory, on device 0 if it did not pick its own yet): the ``local_rank``-th
    entry of ``CUDA_VISIBLE_DEVICES`` (a UUID as it is; an index in CUDA's order,
    which is NVML's PCI order on a node of one GPU model, or with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), else ``local_rank`` itself. None (every GPU)
    without a local rank, or past the visible devices."""
    if local_rank is None:
        return None
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [local_rank]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if local_rank >= len(entries):
        return None
    entry = entries[local_rank]
    return [int(entry)] if entry.isdigit() else [entry]


class FailoverAgent:
    """The peer server and heartbeats (with an HTTP server only: a ``file://`` store
    has nobody to register with, so peers could not find this one), and the health
    agent, which starts with the first ``step()`` so that checkpointers that never
    report steps run no probe."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._health: HealthAgent | None = None
        # The committed step last restored and the timeline it joined (None: not
        # joined), for an agent made after the restore (the first step() is later).
        self._restored: tuple[int, int | None] | None = None
        self.service = self._start_service()

    def _start_service(self) -> PeerService:
        s, c = self.session, self.session.config
        if not isinstance(s.transport, HttpTransport):
            return PeerService(None, None)
        if s.read_only is not None:
            # Heartbeats need write on the job: a token that may only read sends none
            # (not a refused one every interval), and serves no peers, whom nobody
            # would learn of (and whose token comes with heartbeat replies).
            return PeerService(None, Heartbeat(s.transport.url, c.job, c.rank, c.world_size,
                                               c.token, health=c.health, send=False))
        server = None
        if c.serve_peers is None or c.serve_peers:
            # Reachable from other hosts (a replacement node restores from this one),
            # at the address its heartbeats come from (peer/address.py). No token yet:
            # the job's peer token comes with the first heartbeat reply.
            where = peer_address(c.peer_host, toward=s.transport.url)
            server = PeerServer(host=where.bind, advertise_host=where.advertise,
                                port=c.peer_port if c.peer_port is not None
                                else knobs.peer_port(c.local_rank), job=c.job, rank=c.rank,
                                route_to=s.transport.url).start()
        heartbeat = Heartbeat(s.transport.url, c.job, c.rank, c.world_size, c.token,
                              interval=c.heartbeat_interval, health=c.health,
                              launch=heartbeat_launch(given=c.incarnation))
        service = PeerService(server, heartbeat)
        service.start()
        return service

    # -- peers and heartbeats ---------------------------------------------------------

    @property
    def server(self) -> PeerServer | None:
        return self.service.server

    @property
    def heartbeat(self) -> Heartbeat | None:
        return self.service.heartbeat

    @property
    def last_heartbeat_reply(self) -> HeartbeatReply | None:
        hb = self.service.heartbeat
        return hb.last_reply if hb is not None else None

    @property
    def url(self) -> str | None:
        """This rank's peer address (a restore does not ask itself)."""
        return self.service.url

    def note_step(self, step: int) -> None:
        self.service.note_step(step)

    def staging(self) -> None:
        """What peers were served is about to be overwritten."""
        self.service.staging()

    def uploaded(self, index: PeerIndex, committed: bool) -> None:
        """A snapshot is in: serve its chunks to peers (now if committed)."""
        if committed:
            self.service.committed(index)
        else:
            self.service.pending(index)

    def adopted(self, index: PeerIndex, pool: LocalPoolSource, *, beat: bool) -> None:
        """Serves the verified chunks of this node's pool (closes the pool when this
        rank serves no peers)."""
        if self.service.server is not None:
            self.service.adopted(index, pool, beat=beat)
        else:
            pool.close()

    def snapshot_failed(self, message: str) -> None:
        hb = self.service.heartbeat
        if hb is not None:
            hb.note_snapshot_failure(message)

    # -- health -----------------------------------------------------------------------

    def loop_waited(self, seconds: float) -> None:
        """``seconds`` the training loop spent inside ckptd: not its step's time."""
        if self._health is not None:
            self._health.probe.exclude_from_step(seconds)

    def health(self, latest: Callable[[], int | None], epoch: Callable[[], int | None]
               ) -> HealthAgent:
        """The health agent, started on first use (call under the session's lock)."""
        if self._health is None:
            from .health.agent import HealthAgent

            s, c = self.session, self.session.config
            self._health = HealthAgent(
                c.url, c.job, c.rank, c.world_size, c.token,
                policy=c.health_policy, sources=c.health_sources,
                heartbeat=self.service.heartbeat, latest=latest, epoch=epoch,
                disk_paths=[str(s.staging.root), *([c.cache_dir] if c.cache_dir else [])],
                gpus=rank_gpus(c.local_rank),
                timeout=s.timeout or 10.0, restored=self._restored,
                may_write=s.read_only is None,
            ).start()
        return self._health

    def restored(self, step: int, epoch: int | None) -> None:
        """The loop is back at committed ``step``, in timeline ``epoch`` (None: it did
        not join the job's current one): a rollback to it is done."""
        self._restored = (step, epoch)
        if self._health is not None:
            self._health.acknowledge_rollback(step, epoch=epoch)

    # -- lifecycle ----------------------------------------------------------------------

    def close(self, failed: bool) -> None:
        """Stops the health agent, heartbeats and the peer server; a rank with failed
        snapshots beats once more first (the last word on its failures)."""
        c = self.session.config
        hb = self.service.heartbeat
        if hb is not None and failed:
            hb.beat_now()
        if self._health is not None:
            try:
                self._health.close()
            except Exception as exc:  # closing must not fail the caller's shutdown
                log.warning("%s/%d: stopping the health probe failed: %s", c.job, c.rank, exc)
        try:
            self.service.close()
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("%s/%d: stopping heartbeats and the peer server failed: %s",
                        c.job, c.rank, exc)


