"""A token a client put in a URL's query is refused (401: tokens go in the
Authorization header) and never written to the server's access log, which printed
the path whole (found by a probe: ``GET /v1/jobs?token=ckptd_...`` in the log)."""

from __future__ import annotations

from pathlib import Path

import httpx

from ckptd.server.access_log import hide_secrets
from tests.conftest import ServerProcess

SCOPED = "ckptd_0123abcd_Zm9yLWEtdGVzdC1vbmx5LW5vdC1hLXRva2Vu"


def test_a_token_in_a_query_is_not_logged(tmp_path: Path) -> None:
    srv = ServerProcess(store=tmp_path / "store", token="s3cret-token",
                        extra_args=["--access-log"])
    srv.start()
    try:
        for path in ("/v1/jobs?token=s3cret-token", f"/v1/jobs?access_token={SCOPED}",
                     f"/metrics?x=1&key={SCOPED}", f"/?auth={SCOPED}&y=2"):
            assert httpx.get(srv.url + path, timeout=10).status_code in (200, 401)
        httpx.get(srv.url + "/v1/jobs?steps=3", timeout=10)
    finally:
        srv.stop()
    log = srv.log()
    assert "GET /v1/jobs?token=(hidden)" in log, log[-3000:]
    assert "s3cret-token" not in log and SCOPED not in log, log[-3000:]
    assert "/v1/jobs?steps=3" in log  # (the rest of a path as it came)


def test_what_is_hidden() -> None:
    assert hide_secrets(f"/v1/jobs/{SCOPED}/x?a=1&Token=abc&b=2") == (
        "/v1/jobs/(hidden)/x?a=1&Token=(hidden)&b=2")
    assert hide_secrets("/v1/chunks/read?job=j") == "/v1/chunks/read?job=j"
