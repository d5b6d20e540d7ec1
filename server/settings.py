"""Server settings, read from ``CKPTD_*`` variables; explicit arguments win."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class Settings(BaseSettings):
    """How one ``ckptd serve`` process runs."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    store: str = Field(
        default="./ckptd-store",
        description="A directory, file:///path, or memory:// (see open_store).",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=0, le=65535)
    # Kept out of repr so that logging the settings never logs the secret.
    token: str | None = Field(
        default=None, repr=False, description="Bearer token every route needs."
    )
    replica_mismatch: Literal["reject", "warn"] = "reject"
    log_level: str = "info"
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
        default=2, ge=1, description="Steps ahead of the fastest live rank a snapshot is set."
    )
    snapshot_min_interval: float = Field(
        default=30.0, ge=0, description="Seconds between accepted snapshot requests of a job."
    )
    snapshot_timeout: float = Field(
        default=600.0,
        gt=0,
        description="Seconds a coordinated snapshot target stays pending without a commit.",
    )
    metrics_token_required: bool = Field(
        default=False, description="GET /metrics needs the token too (scrapers must send it)."
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

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, value: str | None) -> str | None:
        # CKPTD_TOKEN= (set but empty) means no token, not "the empty token".
        return value or None

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        level = value.lower()
        if level not in LOG_LEVELS:
            raise ValueError(f"log level {value!r} is not one of {', '.join(LOG_LEVELS)}")
        return level
