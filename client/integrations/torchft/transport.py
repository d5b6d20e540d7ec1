"""``CkptdTransport``: torchft's ``CheckpointTransport``, served from a ckptd
staging pool (``send_checkpoint``) and received verified chunk by chunk
(``recv_checkpoint``). The package's docstring tells how."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from torchft.checkpointing.transport import CheckpointTransport

from ckptd import knobs
from ckptd.errors import (
    ChunkHashMismatch,
    ChunkNotFound,
    Conflict,
    InvalidRequest,
    RestoreError,
    Timeout,
    Unauthorized,
    UnsupportedValue,
)
from ckptd.format import Placement, RankManifest, TensorEntry
from ckptd.hashing import chunk_count, chunk_id

from ...dtypes import byte_view, dtype_name, torch_dtype
from ...loop import run_private
from ...peer import PeerClient, PeerIndex, PeerServer, peer_address
from ...restore.fill import fill, plan_fill, tensor_specs, unflatten
from ...restore.keys import check_keys
from ...save.chunks import hash_views
from ...save.flatten import flatten
from ...staging.pool import StagingPool
from .pools import _LIVE, _reap_dead_pools, _watch
from .wire import (
    _METADATA_FORMAT,
    _fetch_verified,
    _parse_metadata,
    _seconds,
    _served_step,
    _wait_for_step,
    _whole,
)

__all__ = ["CkptdTransport", "HealStats"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_CONCURRENCY = 64


@dataclass(slots=True)
class HealStats:
    """What one transport sent and received (counts since it was made)."""

    sends: int = 0
    bytes_staged: int = 0
    receives: int = 0
    bytes_received: int = 0
    chunks_verified: int = 0
    last_send_seconds: float = 0.0
    last_recv_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


_UNROUTED_SAID: set[str | None] = set()  # the lighthouse values warned of, once each


def _say_unrouted(lighthouse: str | None) -> None:
    """A warning, once a process, that the transport advertises 127.0.0.1 because no
    route toward the lighthouse was found: groups on other hosts cannot heal from it."""
    if lighthouse in _UNROUTED_SAID:
        return
    _UNROUTED_SAID.add(lighthouse)
    if lighthouse is None:
        why = "TORCHFT_LIGHTHOUSE is not set and this host has no default route"
    elif "//" not in lighthouse:
        why = f"TORCHFT_LIGHTHOUSE={lighthouse!r} has no scheme (http://host:port)"
    else:
        why = f"the host of TORCHFT_LIGHTHOUSE={lighthouse!r} does not resolve here"
    log.warning("torchft: CkptdTransport advertises its chunk server at 127.0.0.1 (loopback), "
                "which replica groups on other hosts cannot reach: %s. Give "
                "CkptdTransport(advertise_host=...) (or CKPTD_PEER_ADVERTISE_HOST) the "
                "address they reach this host at", why)


class _HealServer(PeerServer):
    """A peer server that also says which manifest describes what it serves (its
    ``/v1/peer`` answer), so that a receiver knows the chunk that lists the others."""

    manifest: tuple[str, int] | None = None  # (its chunk id, its length)

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        held = self.manifest
        if doc.get("step") is not None and held is not None:
            doc["manifest"], doc["manifest_bytes"] = held
        return doc


class CkptdTransport(CheckpointTransport[T]):  # type: ignore[misc,unused-ignore]  # (untyped)
    """torchft's checkpoint transport, served from a ckptd staging pool and
    received verified chunk by chunk.

    ``timeout`` bounds a receive (torchft passes its own per call too): a
    ``timedelta``, as torchft's interface has it, or seconds. The chunk
    server binds ``host:port`` (default ``CKPTD_PEER_HOST``, else
    ``CKPTD_PEER_INTERFACE``'s address, else every interface, for replica groups on
    other hosts; and a port the OS picks) and is reached at ``advertise_host``
    (``CKPTD_PEER_ADVERTISE_HOST``, else that interface's address, else this host's
    address on the route to torchft's lighthouse, ``TORCHFT_LIGHTHOUSE``, or the
    default route).
    Requests carry a bearer token: ``token`` when every replica group is given the
    same one, else a random one per transport that travels in ``metadata()``.
    ``state_dict``: a callable returning a template (e.g. the Manager's state) that
    ``recv_checkpoint`` fills in place and returns (DTensor leaves need one: their
    local shards are sent; without a template they arrive as plain tensors). As
    ``Checkpointer.restore``, a receive refuses a template holding entries the
    sender did not send, and adds those it sent beyond the template.
    ``chunk_size``: bytes per chunk, 4096 to 256 MiB (default ``CKPTD_CHUNK_SIZE``).
    ``shm_dir``: where the staging pool lives (default ``CKPTD_SHM_DIR`` or
    /dev/shm). ``concurrency``: chunks fetched at once, 1 to 64.

    The pool is removed by ``shutdown()``, at the interpreter's exit (an uncaught
    exception included), and, when the process dies otherwise (a signal), by a
    small watcher process that outlives it; a transport starting on the host also
    removes the pools of transports whose processes are gone."""

    def __init__(
        self,
        timeout: timedelta | float = timedelta(seconds=60),
        *,
        host: str | None = None,
        port: int | None = None,
        advertise_host: str | None = None,
        token: str | None = None,
        state_dict: Callable[[], Any] | None = None,
        chunk_size: int | None = None,
        shm_dir: str | None = None,
        concurrency: int = 4,
    ) -> None:
        self.timeout = timedelta(seconds=_seconds(timeout))
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 <= port <= 65535):
            raise InvalidRequest(f"port must be a port from 0 (any) to 65535, not {port!r}")
        self.chunk_size = (knobs.chunk_size() if chunk_size is None else
                           _whole("chunk_size", chunk_size, knobs.MIN_CHUNK_SIZE,
                                  knobs.MAX_CHUNK_SIZE))
        self.concurrency = _whole("concurrency", concurrency, 1, _MAX_CONCURRENCY)
        self.stats = HealStats()
        self._template = state_dict
        self._shared_token = token is not None
        self._token = token or secrets.token_urlsafe(24)
        # A pool of its own, named for this transport (several may live in one
        # process: torchft's tests run replica groups as threads).
        self._label = f"torchft-{secrets.token_hex(4)}"
        _reap_dead_pools(knobs.shm_dir() if shm_dir is None else Path(shm_dir))
        self._pool = StagingPool(self._label, 0, root=shm_dir)
        self._watcher: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one send stages at a time
        self._shut_down = False
        try:
            # Replica groups run on other hosts: every interface (the token guards
            # it), advertised at this host's address on the route to the lighthouse
            # (torchft's TORCHFT_LIGHTHOUSE), as a Checkpointer's peer server is.
            lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE") or None
            try:
                where = peer_address(host, toward=lighthouse, advertise=advertise_host)
            except InvalidRequest:
                raise
            except ValueError as exc:  # urllib's, of the one URL it parses: the lighthouse's
                raise InvalidRequest(
                    f"TORCHFT_LIGHTHOUSE={lighthouse!r} is not a URL ({exc}): set it to the "
                    "lighthouse's http://host:port, or give CkptdTransport(advertise_host=...) "
                    "the address other replica groups reach this host at",
                    setting="TORCHFT_LIGHTHOUSE") from None
            if where.unrouted:
                _say_unrouted(lighthouse)
            self._server = _HealServer(host=where.bind, port=port, token=self._token,
                                       advertise_host=where.advertise, job=self._label,
                                       rank=0)
            self._server.start()
        except BaseException:
            self._pool.close()
            raise
        self._watcher = _watch(self._pool.root, self._label)
        _LIVE.add(self)

    # -- torchft's interface ------------------------------------------------------------

    def metadata(self) -> str:
        """Where this transport serves (and its token, unless all share one)."""
        doc = {"format": _METADATA_FORMAT, "url": self._server.url}
        if not self._shared_token:
            doc["token"] = self._token
        return json.dumps(doc, sort_keys=True)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | float
    ) -> None:
        """Stages ``state_dict`` into the pool, hashes it and serves it as ``step``
        until the next send (the pool holds a copy: the caller may change its state
        as soon as this returns)."""
        t0 = time.perf_counter()
        limit = _seconds(timeout)
        if not isinstance(state_dict, Mapping):
            raise UnsupportedValue(f"torchft sent a {type(state_dict).__name__}, not a state dict")
        flat = flatten(state_dict)
        with self._lock:
            if self._shut_down:
                raise InvalidRequest(
                    "this CkptdTransport was shut down (shutdown() stopped its server and "
                    "removed its staging pool); make a new one to send from")
            # What was served is about to be overwritten: stop serving it first (a
            # receiver still reading it gets 409 from the seqlock, never torn bytes).
            self._server.clear()
            self._server.manifest = None
            plan = self._pool.prepare(flat.tensors, self.chunk_size)
            if plan.piece_count != 1:  # (no budget is set: one piece always)
                raise InvalidRequest("the torchft transport stages a state in one piece")
            piece = self._pool.stage(plan, 0, step)
            piece.wait_copied()
            views = [span.data for span in piece.spans]
            ids = run_private(hash_views(views, self.chunk_size), limit,
                              what="hashing the state to send")
            piece.publish(ids)  # the pool's index: this step, whole (``ckptd shm``)
            entries: list[TensorEntry] = []
            chunks: dict[str, memoryview] = {}
            cs = self.chunk_size
            staged = {span.index: (span, span_ids)
                      for span, span_ids in zip(piece.spans, ids, strict=True)}
            for index, info in enumerate(plan.infos):
                span, span_ids = staged.get(index, (None, []))  # (an empty tensor: none)
                placement: Placement = "local"
                global_shape, offsets = list(info.shape), [0] * len(info.shape)
                if info.name in flat.layouts:  # a DTensor's local shard
                    placement, global_shape, offsets = flat.layouts[info.name]
                entries.append(TensorEntry(
                    name=info.name, dtype=dtype_name(info.dtype), placement=placement,
                    global_shape=list(global_shape), offsets=list(offsets),
                    shape=list(info.shape), nbytes=info.nbytes, chunks=list(span_ids)))
                for k, cid in enumerate(span_ids):
                    if span is not None:
                        chunks.setdefault(cid, span.data[k * cs : (k + 1) * cs])
            manifest = RankManifest(job=self._label, step=step, rank=0, world_size=1,
                                    chunk_size=self.chunk_size, entries=entries,
                                    tree=flat.tree)
            manifest.check()
            data = manifest.canonical()
            mid = chunk_id(data)
            chunks[mid] = memoryview(data)
            generation = piece.generation
            pool = self._pool
            self._server.manifest = (mid, len(data))  # (no step is described before:
            self._server.publish(PeerIndex(step=step, chunks=chunks,  # it was cleared)
                                           valid=lambda: pool.generation == generation))
        seconds = time.perf_counter() - t0
        with self.stats.lock:
            self.stats.sends += 1
            self.stats.bytes_staged += plan.nbytes
            self.stats.last_send_seconds = seconds
        log.info("torchft: serving step %d to ranks %s: %d tensors, %d bytes in %d chunks "
                 "(staged and hashed in %.3f s)", step, dst_ranks, len(entries), plan.nbytes,
                 len(chunks) - 1, seconds)

    def disallow_checkpoint(self) -> None:
        """Nothing to wait for: what is served is the pool's copy, not the caller's
        tensors, and it stays valid (a late receiver still gets exactly its step)
        until the next ``send_checkpoint`` restages the pool."""

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta | float
    ) -> T:
        """Fetches ``step`` from the transport ``metadata`` names, every chunk
        verified; the state (or the ``state_dict`` template, filled in place).

        Raises ``ChunkHashMismatch`` for a chunk (or the manifest) whose bytes do not
        hash to its id, ``Conflict`` when the sender serves another step (or restaged
        during the receive), ``Timeout`` past ``timeout``, ``Unavailable`` when the
        sender cannot be reached; ``RestoreError`` naming the entries the template
        holds that the sender did not send (the template is left as it was); nothing
        is returned then."""
        t0 = time.perf_counter()
        seconds = min(_seconds(timeout), self.timeout.total_seconds())
        deadline = time.monotonic() + seconds
        url, token = _parse_metadata(metadata, self._token)
        client = PeerClient(token, timeout=max(0.1, deadline - time.monotonic()))
        try:
            try:
                mid, size = _wait_for_step(client, url, step, deadline)
            except Unauthorized:
                if token != self._token:  # the sender's own, from its metadata: as it is
                    raise
                raise Unauthorized(
                    f"torchft heal: the healthy group's transport ({url}) refused this "
                    "group's token: every replica group must be given the same "
                    "CkptdTransport(token=...), or none (each then sends its own in "
                    "torchft's metadata); the healthy group was given one, this group "
                    + ("another" if self._shared_token else "none"), peer=url, step=step,
                ) from None
            raw = bytearray(size)
            _fetch_verified(client, url, mid, memoryview(raw), step, "the manifest")
            manifest = RankManifest.parse(bytes(raw))
            if manifest.step != step:
                raise Conflict(f"torchft heal: {url} sent a manifest of step {manifest.step} "
                               f"for step {step}", peer=url, step=step)
            target = self._target(manifest)  # refused before a chunk is fetched
            try:
                tensors = self._fetch_tensors(client, url, manifest, deadline)
            except (ChunkNotFound, Conflict) as exc:
                # A chunk gone (or being overwritten) is the sender's next step staged
                # over this one, unless the sender still serves this step.
                served = _served_step(client, url)
                if served == step:
                    raise
                raise Conflict(
                    f"torchft heal: {url} staged step {served} while step {step} was being "
                    f"received ({exc.message}); nothing was loaded, the next quorum heals "
                    "again", peer=url, step=step, served=served) from None
        finally:
            client.close()
        if target is not None:
            fill(target, manifest.tree, tensors)
            state: Any = target
        else:
            sharded = [e.name for e in manifest.entries if e.placement == "sharded"]
            if sharded:
                raise UnsupportedValue(
                    f"the sender's state holds DTensors ({sharded[0]!r}, ...): give "
                    "CkptdTransport(state_dict=...) a template to receive them into",
                    entries=sharded[:10])
            state = unflatten(manifest.tree, tensors)
        nbytes = manifest.nbytes
        with self.stats.lock:
            self.stats.receives += 1
            self.stats.bytes_received += nbytes
            self.stats.chunks_verified += sum(len(e.chunks) for e in manifest.entries) + 1
            self.stats.last_recv_seconds = time.perf_counter() - t0
        log.info("torchft: received step %d from %s: %d bytes, every chunk verified, %.3f s",
                 step, url, nbytes, time.perf_counter() - t0)
        return state  # type: ignore[no-any-return]

    def shutdown(self, wait: bool = True) -> None:
        """Stops serving and removes the staging pool (a later ``send_checkpoint`` is
        ``InvalidRequest``). Idempotent."""
        self._server.close()
        # (at exit, a send another thread holds the transport in, stuck on a wedged
        # device copy, must not hang the interpreter: its pool is the watcher's then)
        if not self._lock.acquire(timeout=-1 if wait else 2.0):
            log.warning("torchft: a send still holds the transport; its pool is left to "
                        "the watcher, which removes it once this process is gone")
            return
        try:
            self._shut_down = True
            self._pool.close()
            watcher, self._watcher = self._watcher, None
        finally:
            self._lock.release()
        _LIVE.discard(self)
        if watcher is not None:  # its stdin ends: it finds the pool gone and exits
            with contextlib.suppress(OSError):
                watcher.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(5 if wait else 0.1)

    # -- receiving ----------------------------------------------------------------------

    def _target(self, manifest: RankManifest) -> MutableMapping[Any, Any] | None:
        """The template to fill, checked against the sender's manifest while it is
        unchanged (None without one): strict as ``Checkpointer.restore`` is, since an
        entry the sender lacks would keep this group's own value, a stale state."""
        if self._template is None:
            return None
        target = self._template()
        if not isinstance(target, MutableMapping):
            raise InvalidRequest("the state_dict template must return a mutable mapping")
        try:
            check_keys(manifest.tree, target, {}, manifest.step)
        except RestoreError as exc:  # said of the heal: restore's strict=False is not here
            entries = exc.detail.get("entries", [])
            shown = ", ".join(entries[:5]) + (" and more" if len(entries) > 5 else "")
            raise RestoreError(
                f"torchft heal of step {manifest.step}: the sender's state lacks entries "
                f"the state_dict template holds: {shown}; nothing was loaded (every "
                "replica group must hold the same state)",
                entries=entries, step=manifest.step) from None
        plan_fill(target, manifest.tree, tensor_specs(manifest.entries))
        return target

    def _fetch_tensors(self, client: PeerClient, url: str, manifest: RankManifest,
                       deadline: float) -> dict[str, torch.Tensor]:
        """Every entry's tensor, each chunk fetched into place and verified; on the
        first failure no new fetch starts, the running ones finish, it is raised."""
        tensors: dict[str, torch.Tensor] = {}
        jobs: list[tuple[str, memoryview, str]] = []
        cs = manifest.chunk_size
        for e in manifest.entries:
            t = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
            tensors[e.name] = t
            if e.nbytes == 0:
                continue
            view = byte_view(t)
            if len(e.chunks) != chunk_count(e.nbytes, cs):  # (the manifest checked it)
                raise ChunkHashMismatch(f"entry {e.name!r} lists the wrong number of chunks")
            for k, cid in enumerate(e.chunks):
                jobs.append((cid, view[k * cs : (k + 1) * cs], e.name))
        stop = threading.Event()

        def one(job: tuple[str, memoryview, str]) -> None:
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                raise Timeout(f"torchft heal of step {manifest.step} from {url} ran out of "
                              "its timeout", peer=url, step=manifest.step)
            cid, dest, name = job
            _fetch_verified(client, url, cid, dest, manifest.step, f"entry {name!r}")

        with concurrent.futures.ThreadPoolExecutor(self.concurrency,
                                                   thread_name_prefix="ckptd-heal") as pool:
            futures = [pool.submit(one, job) for job in jobs]
            first: BaseException | None = None
            for fut in futures:
                exc = fut.exception()
                if exc is not None and first is None:
                    first = exc
                    stop.set()
            if first is not None:
                raise first
        return tensors
