"""Request and response bodies of the HTTP API that both sides share (the client's
transport parses what the server's routes answer with these same models).

New calls put their models here; ``ckptd.server.models`` keeps the older ones."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ClusterMember", "ClusterView"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterMember(_Body):
    id: str = Field(description="The replica's name (a StatefulSet pod name, host_port).")
    url: str = Field(description="Where clients reach it: http(s)://host:port.")
    expires_at: float | None = Field(
        default=None, description="Unix time its store lease runs out (None: static list)."
    )


class ClusterView(_Body):
    mode: Literal["single", "static", "lease"] = Field(
        description="single: this server alone; static: --peers; lease: leases in the store."
    )
    self_url: str = Field(description="This replica's own URL.")
    members: list[ClusterMember] = Field(description="The live replicas, this one included.")
