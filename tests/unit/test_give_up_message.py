"""What a call that got no answer says when it gives up: the URL it asked, as the
user can reach it."""

from __future__ import annotations

import pytest


def test_a_timed_out_call_to_a_list_of_replicas_names_its_path_apart() -> None:
    """(Found by a probe: "POST http://a:1,http://b:2/v1/jobs/j/ranks/0/heartbeat timed
    out", the path glued onto the list, a URL that is nowhere.)"""
    import httpx

    from ckptd.client import calls
    from ckptd.client.transport_http import Attempts, Session
    from ckptd.errors import Timeout

    urls = "http://127.0.0.1:9,http://localhost:9"
    tries = Attempts(Session(urls, retries=0), calls.latest("j"))
    for _ in tries.waits():
        tries.timed_out(httpx.ReadTimeout("no answer"))
    with pytest.raises(Timeout) as said:
        tries.give_up()
    assert f"GET /v1/jobs/j/latest at {urls} timed out" in str(said.value), said.value


@pytest.mark.parametrize("retries", [0, 2])
def test_a_name_that_does_not_resolve_is_said_with_or_without_retries(retries: int) -> None:
    """(Found by review: with one attempt, CKPTD_RETRIES=0 as the CLI's tests run, the
    name went unsaid, and the CLI advised starting a server there.)"""
    import socket

    import httpx

    from ckptd.client import calls
    from ckptd.client.transport_http import Attempts, Session
    from ckptd.errors import Unavailable

    failed = httpx.ConnectError("[Errno -2] Name or service not known")
    failed.__cause__ = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    tries = Attempts(Session("http://nohost.invalid:8470", retries=retries),
                     calls.latest("j"))
    for _ in tries.waits():
        tries.failed(failed, None)
    with pytest.raises(Unavailable) as said:
        tries.give_up()
    assert "'nohost.invalid' does not resolve" in str(said.value), said.value
    assert said.value.detail.get("unresolved") and not said.value.detail.get("unreached")
