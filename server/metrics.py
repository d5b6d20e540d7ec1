"""Prometheus metrics of one server process, on a per-app ``CollectorRegistry``.

Counters count what this process did since it started; they are not a census of
the store (walking a large store at every scrape is too slow). Rank gauges are
computed from the soft-state registry at scrape time.

``GET /metrics`` keeps tenants apart (docs/SECURITY.md, "Metrics"): without a
token it shows only process and request health (``OPEN``); a token that may read
a job adds that job's own series (``PER_JOB``); everything else (store totals,
whose changes tell whether a chunk was stored already, and every job's series)
needs a token that may read every job. A server without tokens trusts its
network and shows everything. ``CKPTD_METRICS_TOKEN_REQUIRED=true`` closes it
to all but a token on every job."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from ckptd import knobs
from ckptd.errors import CkptdError, Forbidden
from ckptd.repository import Repository
from ckptd.server.auth import auth_configured, authenticate, identify
from ckptd.server.registry import Registry
from ckptd.tokens import Grant

# Commit reasons with their own label value; anything else is "other", so that a
# client cannot grow the label set without bound.
COMMIT_REASONS = ("periodic", "health", "manual", "rollback", "preemption", "final")

_SIZE_BUCKETS = tuple(float(b) for b in (
    64 * 1024, 256 * 1024, knobs.MiB, 4 * knobs.MiB, 16 * knobs.MiB, 64 * knobs.MiB,
))
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Families anyone may scrape: the process's health and the requests' sizes, times and
# refusals, summed over every job (an upload is counted whether or not it was new).
OPEN_PREFIXES = ("process_",)
OPEN = frozenset({"ckptd_chunk_upload_bytes", "ckptd_chunk_upload_seconds",
                  "ckptd_chunk_read_bytes", "ckptd_chunk_read_seconds",
                  "ckptd_uploads_rejected"})
# Families labelled by job that tell a job only of itself: shown, for the jobs it
# may read, to any token. (ckptd_step_unique_bytes is not one: bytes "only this step
# names" drop when another job stores the same chunks.) Any family not named here
# or above needs a token on every job: a new one is closed until it is sorted.
PER_JOB = frozenset({"ckptd_ranks", "ckptd_snapshot_failures", "ckptd_job_stored_bytes",
                     "ckptd_job_logical_bytes", "ckptd_job_dedup_ratio",
                     "ckptd_damaged_steps"})


@dataclass(slots=True)
class Totals:
    """The same counts as plain numbers, for the dashboard's JSON."""

    since: float = field(default_factory=time.time)
    chunks_stored: int = 0
    bytes_stored: int = 0
    chunks_offered: int = 0
    chunks_missing: int = 0
    uploads: int = 0
    upload_bytes: int = 0
    restores: int = 0
    restore_bytes: int = 0
    commits: int = 0
    rejected_uploads: int = 0

    @property
    def dedup_ratio(self) -> float | None:
        if not self.chunks_missing:
            return None
        return self.chunks_offered / self.chunks_missing


class _SoftStateCollector(Collector):
    """Rank states per job and the dedup ratio, computed when scraped."""

    def __init__(self, registry: Registry, totals: Totals) -> None:
        self.registry = registry
        self.totals = totals
        # Jobs that may have a label (None: every job with ranks); set per scrape.
        self.shown: set[str] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ranks = GaugeMetricFamily(
            "ckptd_ranks",
            "Ranks of a job by state (alive, degraded, critical, dead, left), from heartbeats.",
            labels=["job", "state"],
        )
        shown = self.shown
        for job, counts in sorted(self.registry.state_counts().items()):
            # A label only for a job with ranks that heartbeat (authorized), and on
            # an open server only for a job in the store: a request can not mint
            # series (a snapshot request alone, a fuzzer's heartbeats).
            if not any(counts.values()) or (shown is not None and job not in shown):
                continue
            for state, n in counts.items():
                ranks.add_metric([job, state], n)
        yield ranks
        failures = CounterMetricFamily(
            "ckptd_snapshot_failures",
            "Snapshots that failed (upload or commit), as the job's ranks report them in "
            "their heartbeats (a restarted rank counts from zero again).",
            labels=["job"],
        )
        for job, n in sorted(self.registry.snapshot_failures().items()):
            if shown is not None and job not in shown:  # as above: no label from requests
                continue
            failures.add_metric([job], n)
        yield failures
        ratio = self.totals.dedup_ratio
        dedup = GaugeMetricFamily(
            "ckptd_dedup_ratio",
            "Chunk ids offered in missing-chunks calls / ids the store lacked and the caller "
            "was asked to send, since start (NaN before any id was lacking).",
        )
        dedup.add_metric([], ratio if ratio is not None else float("nan"))
        yield dedup


class Metrics:
    """The server's instruments. Each method updates Prometheus and ``totals``."""

    def __init__(self, registry: Registry) -> None:
        self.prometheus = CollectorRegistry(auto_describe=True)
        self.totals = Totals()
        r = self.prometheus
        ProcessCollector(registry=r)  # memory, CPU, descriptors: health anyone may see
        self._chunks_stored = Counter(
            "ckptd_chunks_stored",
            "Chunks this server wrote to the store since it started (new chunks only; "
            "counted since start, not a census of the store).",
            registry=r,
        )
        self._bytes_stored = Counter(
            "ckptd_stored_bytes",
            "Bytes of new chunks this server wrote to the store since it started.",
            registry=r,
        )
        self._offered = Counter(
            "ckptd_chunks_offered",
            "Chunk ids asked about in missing-chunks calls.",
            registry=r,
        )
        self._missing = Counter(
            "ckptd_chunks_missing",
            "Chunk ids the store lacked and that the caller was asked to send "
            "(offered / missing is the dedup ratio).",
            registry=r,
        )
        self._upload_bytes = Histogram(
            "ckptd_chunk_upload_bytes", "Size of chunk uploads.",
            buckets=_SIZE_BUCKETS, registry=r,
        )
        self._upload_seconds = Histogram(
            "ckptd_chunk_upload_seconds",
            "Time to receive, hash and store a chunk upload.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._restore_bytes = Histogram(
            "ckptd_chunk_read_bytes", "Size of chunks read back (GET, restores).",
            buckets=_SIZE_BUCKETS, registry=r,
        )
        self._restore_seconds = Histogram(
            "ckptd_chunk_read_seconds",
            "Time to read, verify and send a chunk (GET, restores).",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._commits = Counter(
            "ckptd_commits",
            "Steps committed through this server, by the commit's meta.reason "
            f"({', '.join(COMMIT_REASONS)} or other).",
            ["reason"], registry=r,
        )
        self._rejected = Counter(
            "ckptd_uploads_rejected",
            "Chunk uploads refused, by error code.",
            ["code"], registry=r,
        )
        self._manifests = Counter(
            "ckptd_manifests_stored", "Rank manifests accepted.", registry=r
        )
        self._heartbeats = Counter("ckptd_heartbeats", "Heartbeats received.", registry=r)
        self._snapshot_requests = Counter(
            "ckptd_snapshot_requests",
            "Coordinated snapshot requests, by whether they set a new target.",
            ["accepted"], registry=r,
        )
        self._soft = _SoftStateCollector(registry, self.totals)
        r.register(self._soft)
        self._counted: OrderedDict[tuple[str, int], None] = OrderedDict()

    def missing_asked(self, offered: int, missing: int) -> None:
        self._offered.inc(offered)
        self._missing.inc(missing)
        self.totals.chunks_offered += offered
        self.totals.chunks_missing += missing

    def chunk_uploaded(self, size: int, seconds: float, created: bool) -> None:
        self._upload_bytes.observe(size)
        self._upload_seconds.observe(seconds)
        self.totals.uploads += 1
        self.totals.upload_bytes += size
        if created:
            self._chunks_stored.inc()
            self._bytes_stored.inc(size)
            self.totals.chunks_stored += 1
            self.totals.bytes_stored += size

    def upload_rejected(self, code: str) -> None:
        self._rejected.labels(code).inc()
        self.totals.rejected_uploads += 1

    def chunk_read(self, size: int, seconds: float) -> None:
        self._restore_bytes.observe(size)
        self._restore_seconds.observe(seconds)
        self.totals.restores += 1
        self.totals.restore_bytes += size

    def committed(self, job: str, step: int, committed_at: float, reason: object) -> None:
        """Counts a commit once: every rank of a step calls commit, and calls after a
        restart may return records committed before this process started."""
        if (job, step) in self._counted or committed_at < self.totals.since:
            return
        self._counted[(job, step)] = None
        while len(self._counted) > 10_000:
            self._counted.popitem(last=False)
        if reason is None:
            label = "periodic"  # the documented default
        else:
            label = reason if isinstance(reason, str) and reason in COMMIT_REASONS else "other"
        self._commits.labels(label).inc()
        self.totals.commits += 1

    def manifest_stored(self) -> None:
        self._manifests.inc()

    def heartbeat(self) -> None:
        self._heartbeats.inc()

    def snapshot_requested(self, accepted: bool) -> None:
        self._snapshot_requests.labels("true" if accepted else "false").inc()


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics: process and request health to anyone; a job's own "
    "series to its tokens; store totals and every job to a token on every job",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Text format"}},
)
async def metrics(request: Request) -> Response:
    settings = request.app.state.settings
    # No header: the open view. A header with a wrong token: 401, so that a scraper
    # set up with a revoked token hears of it rather than scraping less.
    grant = authenticate(request) if (request.headers.get("authorization")
                                      or settings.metrics_token_required) else None
    if settings.metrics_token_required and grant is not None:
        _check_every_job(grant)  # job names of every tenant
    m: Metrics = request.app.state.metrics
    if auth_configured(settings):
        m._soft.shown = None  # ranks exist only through authorized heartbeats
    else:
        grant = identify(request)  # ROOT: a server without tokens trusts its network
        repo: Repository = request.app.state.repository
        try:
            m._soft.shown = set(await repo.list_jobs())
        except CkptdError:
            m._soft.shown = set()
    families = list(m.prometheus.collect())
    if grant is None or not (grant.every_job and grant.may("read", None)):
        families = _visible(families, grant)
    return Response(generate_latest(_Families(families)), media_type=CONTENT_TYPE_LATEST)


def _visible(families: list[Metric], grant: Grant | None) -> list[Metric]:
    """What a caller that may not read every job sees of ``families``."""
    out = []
    for family in families:
        if family.name.startswith(OPEN_PREFIXES) or family.name in OPEN:
            out.append(family)
        elif grant is not None and family.name in PER_JOB:
            mine = Metric(family.name, family.documentation, family.type, family.unit)
            mine.samples = [x for x in family.samples
                            if "job" in x.labels and grant.may("read", x.labels["job"])]
            out.append(mine)
    return out


class _Families(CollectorRegistry):
    """Families already collected, as ``generate_latest`` takes them."""

    def __init__(self, families: list[Metric]) -> None:
        super().__init__(auto_describe=False)
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _check_every_job(grant: Grant) -> None:
    """``read`` on every job (a ``*`` token), not on some job."""
    if not (grant.every_job and grant.may("read", None)):
        raise Forbidden("metrics name every job: they need a read token on '*'",
                        needs="read", job="*")
