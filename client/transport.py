"""How the client reaches a repository: HTTP to a ckptd server, or a store in
process (``file:///path``). Both speak the same small async interface. Every call
to a server is in ``calls.py``; ``transport_http.py`` holds what the async
``HttpTransport`` here and the sync ``SyncTransport`` (heartbeats, the health
agent, the CLI) share.

A little past the house's ~500 lines on purpose: the interface and its two
implementations read side by side, method against method.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from ckptd import knobs
from ckptd.api import ClusterView, StepPlan
from ckptd.cluster import chunk_key as chunk_route_key
from ckptd.cluster import parse_url, parse_urls
from ckptd.errors import (
    CheckpointNotFound,
    InvalidDocument,
    InvalidRequest,
    JobNotFound,
    ManifestHashMismatch,
    Unavailable,
    from_json,
    job_not_found,
)
from ckptd.format import CommitRecord, RankManifest, check_job
from ckptd.hashing import document_hash
from ckptd.lifecycle.damaged_chunks import DamagedChunks
from ckptd.repository import CommitStatus, MissingResult, Repository, StepInfo
from ckptd.repository.reads import committed_rank
from ckptd.store.local import LocalStore

from . import calls
from .calls import Call
from .routing import AsyncRouting
from .stall import guard
from .transport_http import Attempts, Session, SyncTransport, http_error, tls_trouble, tls_verify

if TYPE_CHECKING:
    from .peer.client import PeerClient
    from .transport_reads import BatchedChunkReads

log = logging.getLogger(__name__)

T = TypeVar("T")

# (bytes done, bytes in all)
Progress = Callable[[int, int], None]

__all__ = [
    "CommitStatus",
    "HttpTransport",
    "LocalTransport",
    "MissingResult",
    "StepInfo",
    "SyncTransport",
    "Transport",
    "open_transport",
    "read_step",
    "tls_trouble",
    "tls_verify",
]


class Transport(ABC):
    """The repository operations the client needs, wherever the repository is."""

    @abstractmethod
    async def missing_chunks(self, ids: list[str], claimer: str | None = None) -> MissingResult:
        """Which ids the store lacks; with a claimer, those are leased to it."""

    @abstractmethod
    async def put_chunk(self, cid: str, data: bytes | memoryview) -> bool:
        """Stores one chunk (verified by the repository). True when it was new."""

    @abstractmethod
    async def get_chunk(self, cid: str) -> bytes:
        """One chunk's bytes, not yet verified: the caller checks them against ``cid``."""

    @abstractmethod
    async def put_manifest(self, manifest: RankManifest) -> str:
        """Stores a rank manifest; returns its hash."""

    @abstractmethod
    async def commit(self, job: str, step: int, meta: dict[str, Any] | None = None) -> CommitStatus:
        """Commits the step if every rank is in; else says which ranks are missing."""

    @abstractmethod
    async def latest(self, job: str) -> int | None:
        """The newest committed step of ``job``, or None."""

    @abstractmethod
    async def rollback_state(self, job: str) -> tuple[int | None, int]:
        """(the step the job is marked to roll back to, or None; the job's epoch:
        how many rollbacks it has had). Manifests carry the epoch."""

    async def epoch(self, job: str) -> int:
        return (await self.rollback_state(job))[1]

    async def restorable(self, job: str) -> tuple[int | None, list[str]]:
        """The step a restore of "latest" gets, and the damaged documents that made
        it older than the ``latest`` ref (none when it is that step)."""
        return await self.latest(job), []

    @abstractmethod
    async def read_commit(self, job: str, step: int) -> CommitRecord:
        """The commit record of a committed step."""

    @abstractmethod
    async def read_manifest(self, job: str, step: int, rank: int,
                            record: CommitRecord | None = None) -> RankManifest:
        """A rank's manifest of a committed step, checked against the commit record
        (``record``, when the caller read it already: not asked for again)."""

    @abstractmethod
    async def list_jobs(self) -> list[dict[str, Any]]:
        """Every job as ``{"job": str, "latest": int | None}``."""

    @abstractmethod
    async def list_steps(self, job: str) -> list[StepInfo]:
        """Every step of ``job``, committed or pending, oldest first."""

    @abstractmethod
    async def tags(self, job: str) -> dict[str, int]:
        """``job``'s tags, name -> step (``ckptd tag``, ``save(..., tag=)``)."""

    @abstractmethod
    async def verify(
        self, job: str, step: int | None = None, on_bytes: Progress | None = None
    ) -> dict[str, Any]:
        """Checks refs, commit records and manifests and re-hashes the chunks of one
        committed step (or all); the report as a dict with the fields of ``POST
        /v1/jobs/{job}/verify``. ``on_bytes`` gets (bytes checked, bytes in all)."""

    @abstractmethod
    async def close(self) -> None: ...

    def chunk_reader(self) -> Callable[[str, memoryview], None] | None:
        """A blocking reader of one chunk straight into a buffer of its exact size
        (unverified), for a worker thread; None where this transport has none and
        ``get_chunk`` is the way."""
        return None

    def chunk_reads(self, finish: Callable[[memoryview], str]) -> BatchedChunkReads | None:
        """Chunk reads batched per home replica (``transport_reads.py``), each chunk
        passed to ``finish`` (its verification) in the reading thread; None where this
        transport has none. The caller closes it."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """Where this transport goes, for logs."""


# -- in process -------------------------------------------------------------------------


class LocalTransport(Transport):
    """A repository over a store in this process (no server)."""

    def __init__(self, repository: Repository) -> None:
        self.repository = repository
        if repository.damaged is None:  # (what scrub marked: never deduplicated against)
            repository.damaged = DamagedChunks(repository)

    @classmethod
    def open(cls, path: str, *, create: bool = True) -> LocalTransport:
        """The store in directory ``path``; ``create=False``: ``NotFound`` when there
        is none (a reader's mistyped path), rather than a new, empty one."""
        return cls(Repository(LocalStore(path, create=create)))

    async def missing_chunks(self, ids: list[str], claimer: str | None = None) -> MissingResult:
        return await self.repository.missing_chunks(ids, claimer)

    async def put_chunk(self, cid: str, data: bytes | memoryview) -> bool:
        return await self.repository.put_chunk(cid, data)

    async def get_chunk(self, cid: str) -> bytes:
        # The client verifies every chunk on arrival; hashing here too would be twice.
        return await self.repository.get_chunk(cid, verify=False)

    async def put_manifest(self, manifest: RankManifest) -> str:
        return await self.repository.put_manifest(manifest)

    async def commit(self, job: str, step: int, meta: dict[str, Any] | None = None) -> CommitStatus:
        return await self.repository.commit(job, step, meta=meta)

    async def latest(self, job: str) -> int | None:
        # What a server answers (and a restore of latest uses): the newest usable step.
        return (await self.restorable(job))[0]

    async def restorable(self, job: str) -> tuple[int | None, list[str]]:
        found = await self.repository.restorable_step(check_job(job))
        return found.step, found.problems

    async def rollback_state(self, job: str) -> tuple[int | None, int]:
        marker, epoch = await self.repository.rollback_state(check_job(job))
        return (marker.step if marker is not None else None), epoch

    async def read_commit(self, job: str, step: int) -> CommitRecord:
        return await self.repository.read_commit(job, step)

    async def read_manifest(self, job: str, step: int, rank: int,
                            record: CommitRecord | None = None) -> RankManifest:
        return await self.repository.read_manifest(job, step, rank)  # (a local read)

    async def list_jobs(self) -> list[dict[str, Any]]:
        jobs = await self.repository.list_jobs()

        async def one(job: str) -> dict[str, Any]:
            # One damaged (or newer-format) ref must not hide the other jobs.
            latest, unreadable = await self.repository.latest_or_damage(job)
            return {"job": job, "latest": latest, **unreadable}

        return list(await asyncio.gather(*(one(j) for j in jobs)))

    async def list_steps(self, job: str) -> list[StepInfo]:
        return await self.repository.list_steps(check_job(job))

    async def tags(self, job: str) -> dict[str, int]:
        from ckptd.lifecycle.tags import read_tags

        return await read_tags(self.repository.store, check_job(job))

    async def verify(
        self, job: str, step: int | None = None, on_bytes: Progress | None = None
    ) -> dict[str, Any]:
        report = await self.repository.verify(check_job(job), step, on_bytes=on_bytes)
        return {**asdict(report), "ok": report.ok}

    async def close(self) -> None:
        await self.repository.close()

    def describe(self) -> str:
        return self.repository.store.describe()


# -- HTTP -----------------------------------------------------------------------------


class HttpTransport(Transport):
    """A ckptd server over HTTP: one pooled client routed over the replicas, bearer
    token, retries with exponential backoff on connection errors and 5xx, typed
    errors from JSON bodies (``transport_http.py``, shared with ``SyncTransport``),
    every answer read with the core's model (``calls.py``)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        backoff: float | None = None,
        concurrency: int | None = None,
        job: str | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        self.session = Session(url, token, job=job, timeout=timeout, retries=retries,
                               backoff=backoff, ca_bundle=ca_bundle)
        self.members = self.session.members
        self.url = self.session.url
        self.timeout = self.session.timeout
        pool = max(16, 2 * (concurrency or knobs.upload_concurrency()))
        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        # httpx ignores a client's verify= once it is given a transport: the inner one
        # carries the TLS settings.
        self._routing = AsyncRouting(
            self.members, guard(httpx.AsyncHTTPTransport(
                limits=limits, verify=self.session.verify,
                socket_options=self.session.socket_options()), self.members.mark_gone),
            # (probes of a replica that keeps a request waiting: a pool of their own)
            probes=httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=8, max_keepalive_connections=0),
                verify=self.session.verify),
        )
        self._client = httpx.AsyncClient(
            base_url=self.members.seeds[0],
            headers=self.session.headers,
            timeout=self.session.timeouts(),
            limits=limits,
            transport=self._routing,
        )
        self._raw: PeerClient | None = None  # chunk_reader's, made on first use

    async def run(self, call: Call[T]) -> T:
        """One call, with retries; its answer read with the core's model."""
        tries = Attempts(self.session, call)
        for wait in tries.waits():
            if wait:
                await asyncio.sleep(wait)
            try:
                resp = await self._client.request(call.method, call.path,
                                                  **self.session.arguments(call))
            except httpx.TimeoutException as exc:
                tries.timed_out(exc)
                continue
            except httpx.RequestError as exc:
                tries.failed(exc, await asyncio.to_thread(tls_trouble, self.url, exc))
                continue
            if tries.answered(resp):
                return call.read(resp)
        tries.give_up()

    async def send_once(self, call: Call[Any], timeout: httpx.Timeout) -> httpx.Response:
        """One try of ``call`` within ``timeout`` (no retries): its answer, unread."""
        args = self.session.arguments(call)
        args["timeout"] = timeout
        return await self._client.request(call.method, call.path, **args)

    async def missing_chunks(self, ids: list[str], claimer: str | None = None) -> MissingResult:
        # Each id is asked of its home replica, where its upload goes and its claim is.
        groups = await self._routing.by_home(ids, self._client.headers)
        docs = await asyncio.gather(*(self.run(calls.missing_chunks(group, claimer))
                                      for group in groups))
        return MissingResult(missing=[c for d in docs for c in d.missing],
                             in_flight=[c for d in docs for c in d.in_flight])

    async def put_chunk(self, cid: str, data: bytes | memoryview) -> bool:
        return await self.run(calls.put_chunk(cid, _Pieces(data), memoryview(data).nbytes))

    async def get_chunk(self, cid: str) -> bytes:
        return await self.run(calls.get_chunk(cid))

    async def put_manifest(self, manifest: RankManifest) -> str:
        manifest.check()
        digest = (await self.run(calls.put_manifest(manifest))).hash
        if digest != manifest.digest():
            raise ManifestHashMismatch(
                f"the server stored rank {manifest.rank}'s manifest under hash {digest}, "
                f"expected {manifest.digest()}",
                rank=manifest.rank,
            )
        return digest

    async def commit(self, job: str, step: int, meta: dict[str, Any] | None = None) -> CommitStatus:
        doc = await self.run(calls.commit(job, step, meta))
        return CommitStatus(state=doc.state, job=doc.job, step=doc.step,
                            world_size=doc.world_size, missing_ranks=list(doc.missing_ranks),
                            record=doc.record)

    async def latest(self, job: str) -> int | None:
        return (await self.restorable(job))[0]

    async def restorable(self, job: str) -> tuple[int | None, list[str]]:
        try:
            doc = await self.run(calls.latest(job))
        except CheckpointNotFound:
            return None, []
        return doc.step, list(doc.problems)

    async def rollback_state(self, job: str) -> tuple[int | None, int]:
        doc = await self.run(calls.rollback(job))
        return doc.rollback_to, doc.epoch

    async def read_commit(self, job: str, step: int) -> CommitRecord:
        return await self.run(calls.read_commit(job, step))

    async def read_manifest(self, job: str, step: int, rank: int,
                            record: CommitRecord | None = None) -> RankManifest:
        if record is None or (record.job, record.step) != (job, step):
            record = await self.read_commit(job, step)
        committed_rank(record, rank)  # (as the server and a local read answer it)
        content = await self.run(calls.get_manifest(job, step, rank))
        # Hash the bytes as they came, before parsing: only the committed bytes pass.
        expected = record.manifests[rank].hash
        if await asyncio.to_thread(document_hash, content) != expected:
            raise ManifestHashMismatch(
                f"manifest of rank {rank}, step {step} of {job} does not match its commit "
                "record",
                rank=rank,
                step=step,
            )
        manifest = RankManifest.parse(content, expected)
        if (manifest.job, manifest.step, manifest.rank) != (job, step, rank):
            raise InvalidDocument(
                f"asked for rank {rank} of step {step} of {job}, got rank {manifest.rank} of "
                f"step {manifest.step} of {manifest.job}"
            )
        return manifest

    async def list_jobs(self) -> list[dict[str, Any]]:
        doc = await self.run(calls.jobs())
        # "damaged" / "unsupported" only where a job's latest ref is damaged / newer
        return [{"job": j.job, "latest": j.latest, **({"damaged": j.damaged} if j.damaged else {}),
                 **({"unsupported": j.unsupported} if j.unsupported else {})}
                for j in doc.jobs]

    async def list_steps(self, job: str) -> list[StepInfo]:
        doc = await self.run(calls.steps(job))
        return [StepInfo(step=s.step, committed=s.committed, world_size=s.world_size,
                         ranks_present=s.ranks_present, logical_bytes=s.logical_bytes,
                         committed_at=s.committed_at, is_latest=s.is_latest, damaged=s.damaged,
                         unsupported=s.unsupported)
                for s in doc.steps]

    async def tags(self, job: str) -> dict[str, int]:
        return await self.run(calls.tags(job))

    async def verify(
        self, job: str, step: int | None = None, on_bytes: Progress | None = None
    ) -> dict[str, Any]:
        # Verify re-reads every chunk server side: allow it far longer than a request.
        timeout = self.timeout * 20
        if on_bytes is None:
            return (await self.run(calls.verify(job, step, timeout))).model_dump(mode="json")
        # Streamed: progress lines, then the report (no retries: it is long and idempotent,
        # the caller runs it again).
        call = calls.verify_stream(job, step, timeout)
        async with self._client.stream(call.method, call.path,
                                       **self.session.arguments(call)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise http_error(resp)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if "report" in item:
                    return calls.verify_report(item["report"]).model_dump(mode="json")
                if "error" in item:
                    raise from_json(item["error"], 500)
                on_bytes(int(item["bytes_checked"]), int(item["bytes_total"]))
        raise Unavailable(f"the server ended the verify of {job} without a report", url=self.url)

    async def healthz(self) -> dict[str, Any]:
        """The server's ``/healthz`` answer."""
        return (await self.run(calls.healthz())).model_dump(mode="json", exclude_none=True)

    async def restore_plan(self, job: str, rank: int, step: int) -> dict[str, Any]:
        """The job's home replica's restore plan for ``rank`` at ``step`` (the JSON of
        ``GET /v1/jobs/{job}/restore-plan``, checked against ``RestorePlan``)."""
        return await self.run(calls.restore_plan(job, rank, step))

    async def step_plan(self, job: str, rank: int, step: int | None) -> StepPlan:
        """Every rank's manifest of ``step`` and its live holders, from the job's home
        replica in one request (``GET /v1/jobs/{job}/step-plan``); not yet checked
        against the commit record (``restore.plan.load_step`` does)."""
        return await self.run(calls.step_plan(job, rank, step))

    async def cluster(self) -> ClusterView:
        """The live replicas, as the first live one lists them (``GET /v1/cluster``)."""
        return await self.run(calls.cluster())

    async def close(self) -> None:
        await self._client.aclose()
        if self._raw is not None:
            self._raw.close()

    def chunk_reader(self) -> Callable[[str, memoryview], None] | None:
        """Chunks read from their home replica over kept-alive blocking sockets,
        straight into the caller's buffer (the peer client's wire code: a GET and a
        Content-Length body, about a third of httpx's CPU). Plain-HTTP replicas
        only; a read that fails is retried through ``get_chunk`` by the caller."""
        raw = self._raw_client()
        if raw is None:
            return None

        def read(cid: str, dest: memoryview) -> None:
            raw.fetch_into(self._home(cid), cid, dest)

        return read

    def chunk_reads(self, finish: Callable[[memoryview], str]) -> BatchedChunkReads | None:
        """Several chunks of one home replica per request (``POST /v1/chunks/read``),
        over the same kept-alive sockets as ``chunk_reader``; plain-HTTP replicas
        only. A read that fails is retried through ``get_chunk`` by the caller."""
        raw = self._raw_client()
        if raw is None:
            return None
        from .transport_reads import BatchedChunkReads

        def watch(home: str) -> contextlib.AbstractAsyncContextManager[None]:
            # (a replica that hangs mid-answer: marked down, its reads end at once)
            return self._routing.watching(home, lambda: raw.cut(home))

        return BatchedChunkReads(raw.fetch_many_into, self._home, finish,
                                 alone=lambda: len(self.members.urls) <= 1, watch=watch)

    def _home(self, cid: str) -> str:
        return self.members.order(chunk_route_key(cid))[0]

    def _raw_client(self) -> PeerClient | None:
        """The raw-socket client of chunk reads (made on first use); None for TLS."""
        if not all(u.startswith("http://") for u in self.members.seeds):
            return None
        if self._raw is None:
            from .peer.client import PeerClient

            self._raw = PeerClient(headers=self.session.headers, timeout=self.timeout,
                                   label="ckptd server")
        return self._raw

    def describe(self) -> str:
        return self.url


class _Pieces:
    """A chunk body for httpx, sent straight from the caller's buffer (the staging
    pool) in 1 MiB slices: ``bytes(chunk)`` would copy every chunk whole, and h11 then
    copies what it is given once more. Each retry iterates it afresh. (Only
    ``__aiter__``: httpx would take a plain iterable of a memoryview as ints.)"""

    PIECE = knobs.MiB

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data).cast("B")

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        view = self.data
        for start in range(0, len(view), self.PIECE):
            yield view[start : start + self.PIECE]


def open_transport(
    url: str, token: str | None = None, job: str | None = None, *, ca_bundle: str | None = None,
    create: bool = True,
) -> Transport:
    """A transport for ``http(s)://host:port`` (a ckptd server), or a store used in
    this process: ``file:///path`` (a local directory) or ``s3://bucket/prefix``
    (``ckptd.store.open_store``'s URL). ``job``: the job its chunk calls act for (a
    scoped token's server needs it). ``ca_bundle``: a PEM file of the CA that signed
    an https:// server's certificate (default ``CKPTD_CA_BUNDLE``).
    ``create=False`` (readers): a ``file://`` path or an ``s3://`` prefix with no
    store is ``NotFound`` naming it, not a new, empty store; writers leave it True."""
    parsed = parse_url(url)
    if parsed.scheme in ("http", "https"):
        parse_urls(url)  # (several replicas: each checked)
        return HttpTransport(url, token, job=job, ca_bundle=ca_bundle)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidRequest(f"file URL {url!r} must name a local path (file:///path)")
        if not parsed.path:
            raise InvalidRequest(f"file URL {url!r} names no path")
        return LocalTransport.open(parsed.path, create=create)
    if parsed.scheme == "s3":
        from ckptd.store import open_store

        return LocalTransport(Repository(open_store(url, direct=True, create=create)))
    raise InvalidRequest(f"unsupported URL {url!r}: use http://host:port, file:///path or "
                         "s3://bucket/prefix")


async def read_step(
    transport: Transport, job: str, step: int | None = None
) -> tuple[int, list[RankManifest]]:
    """A committed step (``None``: the latest) and every rank's manifest, in rank
    order, each checked against the commit record."""
    if step is None:
        step, problems = await transport.restorable(job)
        if step is None:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
        if problems:  # (an export read the older step and said only "ok: step N")
            log.warning("%s: reading step %d, the newest usable one: %s", job, step,
                        "; ".join(problems))
    record = await transport.read_commit(job, step)
    manifests = await asyncio.gather(
        *(transport.read_manifest(job, step, r) for r in range(record.world_size))
    )
    return step, list(manifests)


async def missing_job(transport: Transport, job: str) -> JobNotFound | None:
    """``JobNotFound`` naming the jobs there when the store holds no step of ``job``
    at all (through a server, the jobs its token may see); None when it does."""
    if await transport.list_steps(job):
        return None
    repository = getattr(transport, "repository", None)
    if repository is not None:  # a store used directly: the names alone
        jobs = list(await repository.list_jobs())
    else:
        jobs = [j["job"] for j in await transport.list_jobs()]
    return job_not_found(job, jobs, transport.describe())
