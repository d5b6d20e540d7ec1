"""The application factory and the uvicorn runner."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import logging
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from ckptd import __version__
from ckptd.cluster import loopback_host, normalize_url, parse_urls
from ckptd.repository import Repository
from ckptd.server.cluster import Membership, membership_mode, membership_warnings
from ckptd.server.connections import connection_cap, quiet_repeats, raise_fd_limit
from ckptd.server.dashboard import install_dashboard
from ckptd.server.errors import install_error_handlers
from ckptd.server.ingest import connection_protocol
from ckptd.server.metrics import Metrics
from ckptd.server.metrics import router as metrics_router
from ckptd.server.native_heap import bound_native_heap
from ckptd.server.registry import Registry, StoreViews
from ckptd.server.routes import chunks, coordination, health, jobs, lifecycle, manifests, ranks
from ckptd.server.routes import cluster as cluster_routes
from ckptd.server.routes.chunks import direct_chunk_app
from ckptd.server.settings import Settings
from ckptd.server.tenancy import TenantChunks
from ckptd.store import Store, open_store
from ckptd.tokens import TokenFile

log = logging.getLogger(__name__)

# Seconds that a SIGTERM'd server waits for requests in flight before it stops.
GRACEFUL_SHUTDOWN_S = 30
# Seconds an idle kept-alive connection stays open: well over the 5 s for which
# clients (httpx's default, ckptd's own) keep one in their pools, so a client never
# reuses a connection that the server is closing as the request arrives (uvicorn's
# default is those same 5 s: a request met by a closed connection, a replica
# taken for down). The connection cap closes idle ones first when it must.
KEEP_ALIVE_S = 20


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Opens the store and the repository over it; closes them at shutdown."""
    settings: Settings = app.state.settings
    store = app.state.store_override or open_store(settings.store)
    repository = Repository(store, replica_mismatch=settings.replica_mismatch,
                            manifest_cache_bytes=settings.manifest_cache_bytes)
    app.state.repository = repository
    repository.keep_manifests_from_collector()  # GC pauses stalled every request
    # Refs are re-read at most once per heartbeat interval per job.
    app.state.views = StoreViews(repository, ttl=settings.heartbeat_interval)
    app.state.tenants = TenantChunks(repository, app.state.views)
    log.info("serving store %s", store.describe())
    app.state.membership = Membership(
        store,
        own_url(settings),
        peers=settings.peers,
        leases=settings.member_leases,
        member_id=settings.member_id,
        ttl=settings.member_ttl,
        token=settings.token,
        peer_check_s=settings.peer_check_interval,
    )
    await app.state.membership.start()
    app.state.lifecycle = await lifecycle.start(app, repository)
    try:
        yield
    finally:
        await app.state.lifecycle.stop()
        await app.state.membership.stop()
        await repository.close()
        log.info("closed store %s", store.describe())


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    """A ckptd server application over ``settings.store`` (read from CKPTD_* when
    ``settings`` is None). ``store`` replaces the configured one: tests pass a
    wrapper store (fault injection, latency) this way."""
    app = FastAPI(
        title="ckptd",
        summary="Checkpoint service for distributed PyTorch training",
        version=__version__,
        lifespan=lifespan,
        # One schema per model: the manifest PUT refers to RankManifest by name.
        separate_input_output_schemas=False,
        # Swagger UI and ReDoc load their assets from a CDN, so they fail offline:
        # /docs points to docs/API.md and /openapi.json instead (routes/health.py).
        docs_url=None,
        redoc_url=None,
    )
    settings = settings if settings is not None else Settings()
    app.state.settings = settings
    app.state.store_override = store
    # Soft state: lives as long as this application, rebuilt by heartbeats.
    app.state.registry = Registry(
        interval=settings.heartbeat_interval,
        dead_after=settings.dead_after,
        snapshot_lead=settings.snapshot_lead,
        snapshot_min_interval=settings.snapshot_min_interval,
        snapshot_timeout=settings.snapshot_timeout,
        max_jobs=settings.heartbeat_max_jobs,
        max_ranks=settings.heartbeat_max_ranks,
        signal_bytes=settings.heartbeat_signal_bytes,
    )
    app.state.metrics = Metrics(app.state.registry)
    # Scoped tokens (read at startup: a bad file stops the server with its name) and
    # the secret the per-job peer tokens derive from (docs/SECURITY.md).
    app.state.tokens = TokenFile(settings.tokens_file) if settings.tokens_file else None
    app.state.peer_secret = (
        settings.peer_secret.encode("utf-8") if settings.peer_secret else secrets.token_bytes(32)
    )
    for line in _settings_warnings(settings):
        log.warning("%s", line)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(chunks.router)
    app.include_router(manifests.router)
    app.include_router(jobs.router)
    app.include_router(ranks.router)
    app.include_router(coordination.router)
    app.include_router(cluster_routes.router)
    app.include_router(metrics_router)
    app.include_router(lifecycle.router)
    install_dashboard(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def own_url(settings: Settings) -> str:
    """The URL this replica calls itself by: ``--advertise-url``, else host:port."""
    return settings.advertise_url or f"http://{settings.host}:{settings.port}"


def _settings_warnings(settings: Settings) -> list[str]:
    """What ``create_app`` warns of in ``settings``: a peer secret of its own per
    replica, and a server open to other hosts."""
    said = []
    if not settings.peer_secret and (settings.peers or settings.member_leases):
        said.append("CKPTD_PEER_SECRET is not set: this replica makes the jobs' peer tokens "
                    "from a secret of its own, so they change when a job's home moves to "
                    "another replica, and peers refuse each other until the next heartbeat; "
                    "set CKPTD_PEER_SECRET, the same on every replica")
    if not (settings.token or settings.tokens_file) and not loopback_host(settings.host):
        said.append(f"no token (CKPTD_TOKEN, --tokens-file) and listening on {settings.host}, "
                    "beyond this host: any host that reaches this server may save, restore, "
                    "roll back and forget every job; set a token on a network others share "
                    "(docs/SECURITY.md)")
    return said


def _stack_warnings(parser: str) -> list[str]:
    """What ``run`` warns of in the HTTP stack it found (``http_stack``)."""
    if parser != "h11":
        return []
    # Not only slower: the guarded protocol is httptools', so nothing of it holds.
    return ["httptools is not installed, so this server runs the pure-Python h11 parser "
            "WITHOUT a request-header timeout (CKPTD_HEADER_TIMEOUT: slow connections are "
            "never closed) or a connection cap (CKPTD_MAX_CONNECTIONS: connections can "
            "exhaust its file descriptors), and uploads are slower; pip install "
            "'uvicorn[standard]'"]


def start_warnings(settings: Settings) -> list[str]:
    """Every warning ``ckptd serve`` logs as it starts that its settings and this
    install decide (the store's own are ``serve --check``'s already): ``serve
    --check`` says these too, from the same code."""
    peers = parse_urls(settings.peers) if settings.peers else []
    return [*_settings_warnings(settings),
            *membership_warnings(normalize_url(own_url(settings)), peers,
                                 membership_mode(peers, settings.member_leases)),
            *_stack_warnings(http_stack()[0])]


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, less the 422 answers it adds for parameter errors:
    this API answers those with 400 (see ckptd.server.errors), and 422 means a
    chunk whose bytes do not match its id."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                answer = operation.get("responses", {}).get("422", {})
                ref = answer.get("content", {}).get("application/json", {}).get("schema", {})
                if ref.get("$ref", "").endswith("/HTTPValidationError"):
                    del operation["responses"]["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _log_config(level: str) -> dict[str, Any]:
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["ckptd"] = {
        "format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
    }
    config["handlers"]["ckptd"] = {
        "class": "logging.StreamHandler",
        "formatter": "ckptd",
        "stream": "ext://sys.stderr",
    }
    config["loggers"]["ckptd"] = {
        "handlers": ["ckptd"],
        "level": "DEBUG" if level == "trace" else level.upper(),
        "propagate": False,
    }
    config.setdefault("filters", {})["hide_secrets"] = {
        "()": "ckptd.server.access_log.HideSecrets"}
    config["handlers"]["access"].setdefault("filters", []).append("hide_secrets")
    return config


def http_stack() -> tuple[str, str]:
    """(HTTP parser, event loop) uvicorn runs with: httptools and uvloop when they are
    installed (``uvicorn[standard]``), else the pure-Python h11 and asyncio, which
    make large uploads markedly slower (bench/RESULTS.md)."""
    found = {name: importlib.util.find_spec(name) is not None for name in ("httptools", "uvloop")}
    return ("httptools" if found["httptools"] else "h11",
            "uvloop" if found["uvloop"] else "asyncio")


def run(settings: Settings, *, store: Store | None = None) -> None:
    """Serves the application until SIGINT or SIGTERM, then shuts down gracefully:
    no new connections, requests in flight finish (up to GRACEFUL_SHUTDOWN_S), and
    the lifespan closes the store."""
    parser, loop = http_stack()
    app = create_app(settings, store=store)
    app.state.http_parser = parser
    fd_limit = raise_fd_limit()
    bound_native_heap()  # (a server up for weeks: see server/native_heap.py)
    # The event loop takes the GIL back from a document thread within 1 ms, not 5:
    # /healthz stays quick while a large manifest parses (issue 10 item 2).
    sys.setswitchinterval(0.001)
    config = uvicorn.Config(
        app,
        http=parser,
        loop=loop,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=_log_config(settings.log_level),
        access_log=settings.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        server_header=False,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
    )
    if parser == "httptools":
        # The guarded protocol is httptools' with header timeouts and a connection
        # cap, which reads chunk uploads straight into their buffers and answers
        # chunk requests with a lean route.
        chunk_app: Any = direct_chunk_app(app)
        if config.proxy_headers:  # (as uvicorn wraps the application)
            chunk_app = ProxyHeadersMiddleware(chunk_app,
                                               trusted_hosts=config.forwarded_allow_ips)
        config.http = cast(type[asyncio.Protocol], connection_protocol(
            settings.header_timeout, connection_cap(settings.max_connections, fd_limit),
            chunk_app, send_timeout=settings.body_timeout))
    quiet_repeats()  # after uvicorn configured its loggers
    server = uvicorn.Server(config)
    scheme = "https" if settings.tls_cert else "http"
    log.info("starting ckptd %s on %s://%s:%d (HTTP parser %s, event loop %s)", __version__,
             scheme, settings.host, settings.port, parser, loop)
    for line in _stack_warnings(parser):
        log.warning("%s", line)
    server.run()

