"""How the client reaches a repository: HTTP to a ckptd server, or a store in
process (``file:///path``). Both speak the same small async interface.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any
from urllib.parse import urlparse

import httpx

from ckptd import knobs
from ckptd.api import ClusterView
from ckptd.cluster import chunk_key
from ckptd.errors import (
    CheckpointNotFound,
    CkptdError,
    InvalidDocument,
    InvalidRequest,
    ManifestHashMismatch,
    StoreCorrupt,
    StoreFull,
    Timeout,
    Unavailable,
    from_json,
)
from ckptd.format import (
    CommitRecord,
    RankManifest,
    check_chunk_id,
    check_job,
    check_step,
)
from ckptd.hashing import document_hash
from ckptd.repository import CommitStatus, MissingResult, Repository, StepInfo
from ckptd.store.local import LocalStore

from .routing import ROUTE_HEADER, AsyncRouting, members_for

log = logging.getLogger(__name__)

# (bytes done, bytes in all)
Progress = Callable[[int, int], None]

__all__ = [
    "CommitStatus",
    "HttpTransport",
    "LocalTransport",
    "MissingResult",
    "StepInfo",
    "Transport",
    "open_transport",
    "read_step",
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
    async def read_manifest(self, job: str, step: int, rank: int) -> RankManifest:
        """A rank's manifest of a committed step, checked against the commit record."""

    @abstractmethod
    async def list_jobs(self) -> list[dict[str, Any]]:
        """Every job as ``{"job": str, "latest": int | None}``."""

    @abstractmethod
    async def list_steps(self, job: str) -> list[StepInfo]:
        """Every step of ``job``, committed or pending, oldest first."""

    @abstractmethod
    async def verify(
        self, job: str, step: int | None = None, on_bytes: Progress | None = None
    ) -> dict[str, Any]:
        """Checks refs, commit records and manifests and re-hashes the chunks of one
        committed step (or all); the report as a dict with the fields of ``POST
        /v1/jobs/{job}/verify``. ``on_bytes`` gets (bytes checked, bytes in all)."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def describe(self) -> str:
        """Where this transport goes, for logs."""


# -- in process -------------------------------------------------------------------------


class LocalTransport(Transport):
    """A repository over a store in this process (no server)."""

    def __init__(self, repository: Repository) -> None:
        self.repository = repository

    @classmethod
    def open(cls, path: str) -> LocalTransport:
        return cls(Repository(LocalStore(path)))

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
        return await self.repository.latest(check_job(job))

    async def restorable(self, job: str) -> tuple[int | None, list[str]]:
        found = await self.repository.restorable_step(check_job(job))
        return found.step, found.problems

    async def rollback_state(self, job: str) -> tuple[int | None, int]:
        marker, epoch = await self.repository.rollback_state(check_job(job))
        return (marker.step if marker is not None else None), epoch

    async def read_commit(self, job: str, step: int) -> CommitRecord:
        return await self.repository.read_commit(job, step)

    async def read_manifest(self, job: str, step: int, rank: int) -> RankManifest:
        return await self.repository.read_manifest(job, step, rank)

    async def list_jobs(self) -> list[dict[str, Any]]:
        jobs = await self.repository.list_jobs()

        async def one(job: str) -> dict[str, Any]:
            try:
                return {"job": job, "latest": await self.repository.latest(job)}
            except StoreCorrupt as exc:  # one damaged ref must not hide the other jobs
                return {"job": job, "latest": None, "damaged": exc.message}

        return list(await asyncio.gather(*(one(j) for j in jobs)))

    async def list_steps(self, job: str) -> list[StepInfo]:
        return await self.repository.list_steps(check_job(job))

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
    """A ckptd server over HTTP: one pooled client, bearer token, retries with
    exponential backoff on connection errors and 5xx, typed errors from JSON bodies."""

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
        # Several replicas (``http://a:8470,http://b:8470``): requests are routed to
        # their home replica (see routing.py). ``url`` names them all, so that the
        # heartbeat and health clients given it route over the same replicas.
        self.members = members_for(url)
        self.url = ",".join(self.members.seeds)
        self.retries = knobs.retries() if retries is None else retries
        self.backoff = knobs.retry_backoff() if backoff is None else backoff
        self.timeout = knobs.request_timeout() if timeout is None else timeout
        pool = max(16, 2 * (concurrency or knobs.upload_concurrency()))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if job is not None:
            # Chunk routes name no job: a scoped token says which of its jobs acts.
            headers["X-Ckptd-Job"] = check_job(job)
        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        # httpx ignores a client's verify= once it is given a transport: the inner one
        # carries the TLS settings.
        self._routing = AsyncRouting(
            self.members, httpx.AsyncHTTPTransport(limits=limits, verify=tls_verify(ca_bundle))
        )
        self._client = httpx.AsyncClient(
            base_url=self.members.seeds[0],
            headers=headers,
            timeout=httpx.Timeout(self.timeout),
            limits=limits,
            transport=self._routing,
        )

    async def _request(
        self,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        timeout: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request with retries; a typed error for any answer not in ``ok``."""
        attempts = self.retries + 1
        delay = self.backoff
        last: Exception | None = None
        extra: dict[str, Any] = {}
        if timeout is not None:
            extra["timeout"] = httpx.Timeout(timeout)
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(delay)
                delay *= 2
            try:
                resp = await self._client.request(method, path, **kwargs, **extra)
            except httpx.TimeoutException as exc:
                last = exc
                log.debug("%s %s timed out (attempt %d/%d)", method, path, attempt + 1, attempts)
                continue
            except httpx.TransportError as exc:
                trouble = await asyncio.to_thread(tls_trouble, self.url, exc)
                if trouble is not None:  # retrying cannot help a TLS mismatch
                    raise trouble from None
                last = exc
                log.debug("%s %s failed: %s (attempt %d/%d)", method, path, exc, attempt + 1,
                          attempts)
                continue
            if resp.status_code in ok:
                return resp
            error = self._error(resp)
            if resp.status_code >= 500 and not isinstance(error, StoreFull | StoreCorrupt):
                # (a full or damaged store answers the same on a retry)
                last = error
                log.debug("%s %s answered %d (attempt %d/%d)", method, path, resp.status_code,
                          attempt + 1, attempts)
                continue
            raise error
        if isinstance(last, httpx.TimeoutException):
            raise Timeout(
                f"{method} {self.url}{path} timed out {attempts} times", url=self.url
            ) from last
        if isinstance(last, CkptdError) and not isinstance(last, _UntypedServerError):
            raise last
        raise Unavailable(
            f"{method} {self.url}{path} failed after {attempts} attempts: {last}", url=self.url
        ) from last

    @staticmethod
    def _error(resp: httpx.Response) -> CkptdError:
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("code"), str):
            return from_json(body, resp.status_code)
        text = resp.text[:200]
        if resp.status_code >= 500:
            return _UntypedServerError(f"HTTP {resp.status_code}: {text}")
        return CkptdError(f"HTTP {resp.status_code} from {resp.request.url}: {text}")

    async def missing_chunks(self, ids: list[str], claimer: str | None = None) -> MissingResult:
        # Each id is asked of its home replica, where its upload goes and its claim is.
        groups = await self._routing.by_home(ids, self._client.headers)
        docs = await asyncio.gather(*(self._missing(group, claimer) for group in groups))
        return MissingResult(missing=[c for d in docs for c in d["missing"]],
                             in_flight=[c for d in docs for c in d["in_flight"]])

    async def _missing(self, ids: list[str], claimer: str | None) -> Any:
        body: dict[str, Any] = {"ids": ids}
        if claimer is not None:
            body["claimer"] = claimer
        route = {ROUTE_HEADER: chunk_key(ids[0])} if ids else {}
        resp = await self._request("POST", "/v1/chunks/missing", json=body, headers=route)
        return resp.json()

    async def put_chunk(self, cid: str, data: bytes | memoryview) -> bool:
        check_chunk_id(cid)
        resp = await self._request(
            "PUT",
            f"/v1/chunks/{cid}",
            ok=(200, 201),
            content=_Pieces(data),
            headers={"Content-Type": "application/octet-stream",
                     "Content-Length": str(memoryview(data).nbytes)},
        )
        return resp.status_code == 201

    async def get_chunk(self, cid: str) -> bytes:
        check_chunk_id(cid)
        resp = await self._request("GET", f"/v1/chunks/{cid}")
        return resp.content

    async def put_manifest(self, manifest: RankManifest) -> str:
        manifest.check()
        resp = await self._request(
            "PUT",
            f"/v1/jobs/{manifest.job}/steps/{manifest.step}/ranks/{manifest.rank}",
            ok=(200, 201),
            content=manifest.canonical(),
            headers={"Content-Type": "application/json"},
        )
        digest = str(resp.json()["hash"])
        if digest != manifest.digest():
            raise ManifestHashMismatch(
                f"the server stored rank {manifest.rank}'s manifest under hash {digest}, "
                f"expected {manifest.digest()}",
                rank=manifest.rank,
            )
        return digest

    async def commit(self, job: str, step: int, meta: dict[str, Any] | None = None) -> CommitStatus:
        check_job(job)
        check_step(step)
        resp = await self._request(
            "POST", f"/v1/jobs/{job}/steps/{step}/commit", json={"meta": dict(meta or {})}
        )
        doc = resp.json()
        record = doc.get("record")
        return CommitStatus(
            state=doc["state"],
            job=doc["job"],
            step=int(doc["step"]),
            world_size=doc.get("world_size"),
            missing_ranks=list(doc.get("missing_ranks") or []),
            record=None if record is None else _parse_record(record),
        )

    async def latest(self, job: str) -> int | None:
        check_job(job)
        try:
            resp = await self._request("GET", f"/v1/jobs/{job}/latest")
        except CheckpointNotFound:
            return None
        return int(resp.json()["step"])

    async def restorable(self, job: str) -> tuple[int | None, list[str]]:
        check_job(job)
        try:
            doc = (await self._request("GET", f"/v1/jobs/{job}/latest")).json()
        except CheckpointNotFound:
            return None, []
        return int(doc["step"]), [str(p) for p in doc.get("problems", [])]

    async def rollback_state(self, job: str) -> tuple[int | None, int]:
        check_job(job)
        doc = (await self._request("GET", f"/v1/jobs/{job}/rollback")).json()
        step = doc.get("rollback_to")
        return (int(step) if step is not None else None), int(doc["epoch"])

    async def read_commit(self, job: str, step: int) -> CommitRecord:
        check_job(job)
        check_step(step)
        resp = await self._request("GET", f"/v1/jobs/{job}/steps/{step}")
        return CommitRecord.parse(resp.content)

    async def read_manifest(self, job: str, step: int, rank: int) -> RankManifest:
        record = await self.read_commit(job, step)
        if not 0 <= rank < record.world_size:
            raise InvalidRequest(
                f"rank {rank} is outside world size {record.world_size} of step {step}"
            )
        resp = await self._request("GET", f"/v1/jobs/{job}/steps/{step}/ranks/{rank}")
        # Hash the bytes as they came, before parsing: only the committed bytes pass.
        if await asyncio.to_thread(document_hash, resp.content) != record.manifests[rank].hash:
            raise ManifestHashMismatch(
                f"manifest of rank {rank}, step {step} of {job} does not match its commit "
                "record",
                rank=rank,
                step=step,
            )
        manifest = RankManifest.parse(resp.content)
        if (manifest.job, manifest.step, manifest.rank) != (job, step, rank):
            raise InvalidDocument(
                f"asked for rank {rank} of step {step} of {job}, got rank {manifest.rank} of "
                f"step {manifest.step} of {manifest.job}"
            )
        return manifest

    async def list_jobs(self) -> list[dict[str, Any]]:
        resp = await self._request("GET", "/v1/jobs")
        # "damaged" only where a job's latest ref is damaged
        return [{"job": j["job"], "latest": j.get("latest"),
                 **({"damaged": j["damaged"]} if j.get("damaged") else {})}
                for j in resp.json()["jobs"]]

    async def list_steps(self, job: str) -> list[StepInfo]:
        check_job(job)
        resp = await self._request("GET", f"/v1/jobs/{job}/steps")
        return [
            StepInfo(
                step=int(s["step"]),
                committed=bool(s["committed"]),
                world_size=s.get("world_size"),
                ranks_present=int(s["ranks_present"]),
                logical_bytes=s.get("logical_bytes"),
                committed_at=s.get("committed_at"),
                is_latest=bool(s.get("is_latest", False)),
                damaged=s.get("damaged"),
            )
            for s in resp.json()["steps"]
        ]

    async def verify(
        self, job: str, step: int | None = None, on_bytes: Progress | None = None
    ) -> dict[str, Any]:
        check_job(job)
        params = {} if step is None else {"step": check_step(step)}
        if on_bytes is None:
            # Verify re-reads every chunk server side: allow it far longer than a request.
            resp = await self._request(
                "POST", f"/v1/jobs/{job}/verify", params=params, timeout=self.timeout * 20
            )
            doc: dict[str, Any] = resp.json()
            return doc
        # Streamed: progress lines, then the report (no retries: it is long and idempotent,
        # the caller runs it again).
        async with self._client.stream(
            "POST", f"/v1/jobs/{job}/verify", params=params,
            headers={"Accept": "application/x-ndjson"}, timeout=self.timeout * 20,
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise self._error(resp)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if "report" in item:
                    report: dict[str, Any] = item["report"]
                    return report
                if "error" in item:
                    raise from_json(item["error"], 500)
                on_bytes(int(item["bytes_checked"]), int(item["bytes_total"]))
        raise Unavailable(f"the server ended the verify of {job} without a report", url=self.url)

    async def healthz(self) -> dict[str, Any]:
        """The server's ``/healthz`` answer."""
        resp = await self._request("GET", "/healthz")
        doc: dict[str, Any] = resp.json()
        return doc

    async def restore_plan(self, job: str, rank: int, step: int) -> dict[str, Any]:
        """The job's home replica's restore plan for ``rank`` at ``step`` (the JSON of
        ``GET /v1/jobs/{job}/restore-plan``)."""
        check_job(job)
        resp = await self._request(
            "GET", f"/v1/jobs/{job}/restore-plan", params={"rank": rank, "step": step}
        )
        doc: dict[str, Any] = resp.json()
        return doc

    async def cluster(self) -> ClusterView:
        """The live replicas, as the first live one lists them (``GET /v1/cluster``)."""
        resp = await self._request("GET", "/v1/cluster")
        return ClusterView.model_validate_json(resp.content)

    async def close(self) -> None:
        await self._client.aclose()

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


class _UntypedServerError(CkptdError):
    """A 5xx answer without a ckptd error body (a proxy, a crash): retried, then
    reported as ``Unavailable``."""


def _parse_record(doc: Any) -> CommitRecord:
    try:
        return CommitRecord.parse(json.dumps(doc).encode("utf-8"))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CkptdError):
            raise
        raise InvalidDocument(f"the server sent a commit record that is not JSON: {exc}") from None


# A PEM file of the CA(s) that signed an https:// server's certificate.
CA_BUNDLE_ENV = "CKPTD_CA_BUNDLE"


def tls_verify(ca_bundle: str | None = None) -> ssl.SSLContext | bool:
    """What an https:// server's certificate is checked against: ``ca_bundle``,
    else ``CKPTD_CA_BUNDLE``, else the default trust store (``True``)."""
    path = ca_bundle or os.environ.get(CA_BUNDLE_ENV) or None
    if path is None:
        return True
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"CA bundle {path} ({CA_BUNDLE_ENV}) cannot be read: {exc}") from None


def tls_trouble(url: str, exc: BaseException) -> CkptdError | None:
    """The error that says what to do when an https:// connection failed for a TLS
    reason (a plain-HTTP server, an untrusted certificate); None for any other
    failure. Blocking: it may try one plain-HTTP request to tell them apart."""
    parsed = urlparse(url)
    if parsed.scheme != "https" or parsed.hostname is None:
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
            "reverse proxy; README, 'TLS')"
        )
    return None


def _speaks_plain_http(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0) as sock:
            sock.sendall(b"HEAD /healthz HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
            return sock.recv(5) == b"HTTP/"
    except OSError:
        return False


def open_transport(
    url: str, token: str | None = None, job: str | None = None, *, ca_bundle: str | None = None
) -> Transport:
    """A transport for ``http(s)://host:port`` (a ckptd server) or ``file:///path``
    (a local directory store, used in process). ``job``: the job its chunk calls act
    for (a scoped token's server needs it). ``ca_bundle``: a PEM file of the CA that
    signed an https:// server's certificate (default ``CKPTD_CA_BUNDLE``)."""
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https") and "," in url:
        return HttpTransport(url, token)  # several replicas
    if parsed.scheme in ("http", "https"):
        if not parsed.netloc:
            raise InvalidRequest(f"URL {url!r} names no host")
        return HttpTransport(url, token, job=job, ca_bundle=ca_bundle)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidRequest(f"file URL {url!r} must name a local path (file:///path)")
        if not parsed.path:
            raise InvalidRequest(f"file URL {url!r} names no path")
        return LocalTransport.open(parsed.path)
    raise InvalidRequest(f"unsupported URL {url!r}: use http://host:port or file:///path")


async def read_step(
    transport: Transport, job: str, step: int | None = None
) -> tuple[int, list[RankManifest]]:
    """A committed step (``None``: the latest) and every rank's manifest, in rank
    order, each checked against the commit record."""
    if step is None:
        step = await transport.latest(job)
        if step is None:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
    record = await transport.read_commit(job, step)
    manifests = await asyncio.gather(
        *(transport.read_manifest(job, step, r) for r in range(record.world_size))
    )
    return step, list(manifests)
