"""The server runs on httptools and uvloop (uvicorn[standard]) and says so."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from tests.conftest import ServerProcess

REPO = Path(__file__).resolve().parents[2]


def test_dependencies_name_the_fast_http_stack() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("uvicorn[standard]") for d in deps), deps


def test_healthz_and_startup_log_name_parser_and_loop(server: ServerProcess) -> None:
    doc = httpx.get(f"{server.url}/healthz", timeout=5).json()
    assert doc["http_parser"] == "httptools"
    assert doc["event_loop"] == "uvloop"
    assert "HTTP parser httptools, event loop uvloop" in server.log()
