"""How the client words what a server said or where it could not reach (review of
this session's changes): a server's store_error is said as the server's, whatever
its detail holds; a replica is "listed" only when it is not a URL the user gave,
however the user spelt its host."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx

from ckptd.client.reach import _listed_member
from ckptd.client.transport_http import http_error
from ckptd.errors import StoreError


def test_a_store_error_whose_detail_holds_a_message_key_is_read() -> None:
    body = {"code": "store_error", "message": "S3 GetObject failed",
            "detail": {"key": "jobs/j/refs/latest", "message": "theirs"}}
    resp = httpx.Response(500, json=body,
                          request=httpx.Request("GET", "http://10.0.0.5:8470/v1/jobs"))
    error = http_error(resp)  # (a TypeError: two values for 'message')
    assert isinstance(error, StoreError)
    assert error.message.startswith("the ckptd server at http://10.0.0.5:8470 could not use")
    assert error.detail == body["detail"]


def _failed_at(url: str) -> httpx.ConnectError:
    return httpx.ConnectError("refused", request=httpx.Request("GET", url + "/v1/jobs/j/rollback"))


def test_a_url_given_is_not_called_a_listed_replica_however_spelt() -> None:
    transport: Any = SimpleNamespace(members=SimpleNamespace(seeds=["http://Ckptd-0.Svc:8470"]))
    assert _listed_member(transport, _failed_at("http://ckptd-0.svc:8470")) is None
    assert _listed_member(transport, _failed_at("http://ckptd-1.svc:8470")) == (
        "http://ckptd-1.svc:8470")
