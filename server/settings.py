"""Server settings, read from ``CKPTD_*`` variables; explicit arguments win."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptd.cluster import parse_urls
from ckptd.documents import MANIFEST_CACHE_BYTES
from ckptd.lifecycle.gc import MAX_GRACE

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class Settings(BaseSettings):
    """How one ``ckptd serve`` process runs."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    store: str = Field(
        default="./ckptd-store",
        description="A directory, file:///path, s3://bucket/prefix or memory:// (see "
        "open_store).",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8470, ge=0, le=65535, description="Port to listen on.")
    # Kept out of repr so that logging the settings never logs the secret.
    token: str | None = Field(
        default=None, repr=False, description="Bearer token every route needs."
    )
    replica_mismatch: Literal["reject", "warn"] = Field(
        default="reject",
        description="Replicas of a tensor that differ at a commit: reject the step, or warn "
        "and commit it.",
    )
    log_level: str = Field(
        default="info",
        description="The server's log level: critical, error, warning, info, debug or trace.",
    )
    access_log: bool = Field(
        default=True,
        description="Log every request (uvicorn's access log). Off saves ~10% of the "
        "server's per-request CPU under chunk uploads.",
    )
    heartbeat_interval: float = Field(
        default=2.0, gt=0, le=3600, description="Seconds between a rank's heartbeats."
    )
    dead_after: int = Field(
        default=3, ge=1, le=1000, description="Missed heartbeat intervals before a rank is dead."
    )
    snapshot_lead: int = Field(
        default=2, ge=1, description="Least steps ahead of the fastest live rank a snapshot "
        "is set; the server raises it to ceil(2 x heartbeat interval / step time) + 1 from "
        "the step times heartbeats report."
    )
    snapshot_min_interval: float = Field(
        default=30.0, ge=0, description="Seconds between accepted snapshot requests of a job."
    )
    snapshot_timeout: float = Field(
        default=600.0,
        gt=0,
        description="Seconds a coordinated snapshot target stays pending without a commit.",
    )
    tls_cert: str | None = Field(
        default=None, description="PEM certificate (chain): the server speaks https://."
    )
    tls_key: str | None = Field(default=None, description="The certificate's PEM private key.")
    header_timeout: float = Field(
        default=10.0, gt=0, le=3600,
        description="Seconds a connection may take to send a request's headers (slowloris).",
    )
    body_timeout: float = Field(
        default=60.0, gt=0, le=3600,
        description="Seconds a request body may go without sending a byte, and an answer's "
        "reader without taking one (then its connection is closed).",
    )
    max_connections: int = Field(
        default=1000, ge=1,
        description="Open connections at most (and never past the open-file limit); at the "
        "cap a new one closes the connection that has waited longest for its request's "
        "headers, and gets 503 only when every connection has a request under way.",
    )
    ingest_budget: int = Field(
        default=1 << 30, ge=1 << 20,
        description="Bytes of chunk upload bodies held at once by all uploads together.",
    )
    ingest_wait: float = Field(
        default=10.0, ge=0, le=600,
        description="Seconds an upload waits for room in the ingest budget before a 503.",
    )
    metrics_token_required: bool = Field(
        default=False, description="GET /metrics needs the token too (scrapers must send it)."
    )
    tokens_file: str | None = Field(
        default=None,
        description="A tokens file (ckptd token create): scoped tokens, stored hashed.",
    )
    peer_secret: str | None = Field(
        default=None, repr=False,
        description="Secret the per-job peer tokens derive from; the same on every replica "
        "(default: random per process, so peer tokens change when it restarts).",
    )
    peer_networks: str | None = Field(
        default=None,
        description="Comma-separated networks (CIDR) a heartbeat's peer_url may point into; "
        "default: only the heartbeat's own source address. 'any': every URL (names too), for "
        "a network where every host is trusted.",
    )
    # Replicas over one store (see server/cluster.py).
    peers: str | None = Field(
        default=None,
        description="Every replica's URL, comma-separated (a static cluster, e.g. a "
        "StatefulSet's stable names).",
    )
    advertise_url: str | None = Field(
        default=None, description="The URL clients reach this replica at (default host:port)."
    )
    member_leases: bool = Field(
        default=False, description="Keep a lease cluster/members/<id> in the store."
    )
    member_id: str | None = Field(default=None, description="This replica's lease name.")
    member_ttl: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds a member lease lasts unrenewed."
    )
    peer_check_interval: float = Field(
        default=10.0, ge=0, le=3600,
        description="Seconds between a replica's reads of its --peers' store ids "
        "(GET /v1/cluster, with CKPTD_TOKEN): a peer on another store is logged. 0: never.",
    )
    single_writer: bool = Field(
        default=False,
        description="Serve a store that cannot write conditionally (If-None-Match / If-Match "
        "ignored), with this server as its only writer: no replicas, no other server, no "
        "file:// clients. Its conditional writes are then checked under this process's locks.",
    )

    # -- store lifecycle (ckptd.lifecycle; docs/FORMAT.md "Garbage collection") -------
    retention: str | None = Field(
        default=None, description="Retention TOML file ([retention], [retention.jobs.<job>]); "
        "applied after each commit. None: keep every step.",
    )
    gc_interval: float = Field(
        default=0.0, ge=0, description="Seconds between background garbage collections (0: off)."
    )
    gc_grace: float = Field(
        default=600.0, ge=0, le=MAX_GRACE, allow_inf_nan=False,
        description="GC grace period: longer than the longest save (at most 7 days).",
    )
    gc_lease: float = Field(default=60.0, gt=0, description="Seconds a GC lease lasts unrenewed.")
    scrub_interval: float = Field(
        default=0.0, ge=0, description="Seconds between background scrub runs (0: off)."
    )
    scrub_budget_bytes: int = Field(default=256 << 20, ge=0, description="Bytes per scrub run.")
    scrub_rate: float = Field(default=64 << 20, gt=0, description="Scrub bytes per second.")
    scrub_replica: str | None = Field(
        default=None, description="A replica store URL scrub repairs corrupt chunks from "
        "(it must be there: scrub never creates one)."
    )
    scrub_peer_timeout: float = Field(
        default=30.0, gt=0, le=3600,
        description="Seconds a rank's peer server may take to send scrub one chunk (a peer "
        "that trickles bytes otherwise held every scrub of the store).",
    )
    min_free_bytes: int = Field(
        default=256 << 20, ge=0, description="New snapshots are refused (store_full) below this; "
        "`ckptd serve` warns at start when a local store's disk has less (lower it for a "
        "small disk)."
    )
    warn_free_bytes: int = Field(default=2 << 30, ge=0, description="Warn below this free space.")
    max_upload_s: float = Field(
        default=3600.0, gt=0, description="Temporaries older than this are removed at start."
    )
    egress_budget: int = Field(
        default=256 << 20, ge=1 << 20,
        description="Bytes of chunk answers held in memory at once by all reads together "
        "(a store whose chunks are not files here, such as S3; files are served mapped).",
    )
    manifest_cache_bytes: int = Field(
        default=MANIFEST_CACHE_BYTES, ge=0,
        description="Memory the parsed rank manifests a commit and restore plans read again "
        "may hold, estimated (the newest one stays whatever its size).",
    )
    egress_wait: float = Field(
        default=10.0, ge=0, le=600,
        description="Seconds a chunk read waits for room in the egress budget before a 503.",
    )
    # Restores that skip the server (server/presign.py; issue 21, item 3).
    presigned_reads: bool = Field(
        default=True,
        description="Over an S3-compatible store, restore plans carry presigned GET URLs of "
        "the rank's chunks, and ranks read them from the object store, not through this "
        "server. Off: every restore byte goes through the server.",
    )
    presigned_read_seconds: int = Field(
        default=900, ge=30, le=7 * 24 * 3600,
        description="Seconds a restore plan's presigned URLs stay valid (30 to 604800, "
        "S3's longest).",
    )
    heartbeat_signal_bytes: int = Field(
        default=16 << 10, ge=1024,
        description="Bytes of health signals (names and values) kept per rank; the rest of "
        "a heartbeat's signals are dropped.",
    )
    heartbeat_max_ranks: int = Field(
        default=65536, ge=1,
        description="Ranks whose heartbeats this server keeps, all jobs together; a new rank "
        "past it is refused (too_large) until others are forgotten.",
    )
    heartbeat_max_jobs: int = Field(
        default=4096, ge=1,
        description="Jobs whose heartbeats this server keeps; a new job past it is refused "
        "(too_large) until others are forgotten.",
    )

    @model_validator(mode="after")
    def _tls_cert_and_key_together(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both tls_cert and tls_key (or neither)")
        return self

    @field_validator("token", "tokens_file", "peer_secret", "peer_networks", "retention",
                     "tls_cert", "tls_key", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: str | None) -> str | None:
        # CKPTD_TOKEN= (set but empty) means no token, not "the empty token"; an empty
        # file setting (a template's unset value) is no file, not the directory ''.
        return value or None

    @field_validator("token", "peer_secret")
    @classmethod
    def _secret_as_sent(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Without the whitespace around it (a secret file's last newline), as clients
        # send a token. A token with a character no header can carry could never match;
        # the peer secret is only a key the peer tokens derive from, never sent.
        value = (value or "").strip() or None
        if (info.field_name == "token" and value is not None
                and any(not "!" <= c <= "~" for c in value)):
            raise ValueError("holds a space, a control or a non-ASCII character, which no "
                             "token sent in a header can: copy it again")
        return value

    @field_validator("peer_networks")
    @classmethod
    def _networks_parse(cls, value: str | None) -> str | None:
        for item in (value or "").split(","):
            if item.strip() and item.strip() != "any":
                ipaddress.ip_network(item.strip(), strict=False)  # ValueError names it
        return value

    def peer_network_list(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The networks of ``peer_networks``, parsed."""
        return [ipaddress.ip_network(item.strip(), strict=False)
                for item in (self.peer_networks or "").split(",")
                if item.strip() and item.strip() != "any"]

    @property
    def any_peer_url(self) -> bool:
        """``peer_networks`` says 'any': peer URLs are not checked."""
        return "any" in {item.strip() for item in (self.peer_networks or "").split(",")}

    @field_validator("peers", "advertise_url")
    @classmethod
    def _replica_urls(cls, value: str | None, info: ValidationInfo) -> str | None:
        # What clients and the other replicas are told to reach: an ftp:// or a
        # path here made every routed call fail later, far from its cause.
        if not value:
            return None
        urls = parse_urls(value)  # InvalidRequest (a ValueError) names a bad one
        if info.field_name == "advertise_url" and len(urls) > 1:
            raise ValueError(f"{value!r} is several URLs; advertise one: http(s)://host:port")
        return value

    @field_validator("scrub_replica")
    @classmethod
    def _replica_store_there(cls, value: str | None) -> str | None:
        # Opened by the server's lifespan: a URL no store has was a traceback from
        # there, and a mistyped path an empty directory made and "repaired" from.
        if not value:
            return None
        from ckptd.lifecycle.scrub import replica_store

        replica_store(value)  # InvalidRequest (a ValueError) says what is wrong
        return value

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        level = value.lower()
        if level not in LOG_LEVELS:
            raise ValueError(f"log level {value!r} is not one of {', '.join(LOG_LEVELS)}")
        return level
