"""An S3 store at an endpoint that does not answer as S3 should: one that takes no
connection, one that takes it and never answers, https:// at a plain-HTTP S3, a
host name that does not exist, another program, an expired session token. Each
fails in bounded time with one line that says what to do, and the store probe
cleans up after itself in bounded time too. Real sockets and moto's S3 server."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

pytest.importorskip("aiobotocore")
pytest.importorskip("moto.server")

from ckptd.errors import StoreError  # noqa: E402
from ckptd.store import S3Store  # noqa: E402
from ckptd.store.probe import conditional_write_gaps  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.listeners import http_program, silent_listener  # noqa: E402
from tests.store import test_s3  # noqa: E402

BUCKET = test_s3.BUCKET
endpoint = test_s3.endpoint  # moto's S3 server, this module's own

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _aws(endpoint: str) -> None:
    """Every test here with moto's dummy credentials, and no AWS setting of the user's."""


@pytest.fixture
def knobs_for(monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(f"CKPTD_{name}", value)
    return set_


@pytest.fixture
def silent() -> Iterator[str]:
    """An endpoint that takes connections (the kernel's backlog) and never answers."""
    with silent_listener() as url:
        yield url


@pytest.fixture
def full() -> Iterator[str]:
    """An endpoint that takes no connection: its one-slot backlog is full, so the
    kernel drops every SYN (a host gone dark), and connecting waits."""
    with socket.socket() as sock, socket.socket() as filler:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        filler.connect(sock.getsockname())
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


class Sent:
    """Counts the requests a store's client sends, by operation and key."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    def __call__(self, request: Any, event_name: str, **_: Any) -> None:
        self.requests.append((event_name.rsplit(".", 1)[-1], request.url.rsplit("/", 1)[-1]))

    async def watch(self, store: S3Store) -> Sent:
        (await store._client()).meta.events.register("before-send.s3", self)
        return self


async def failing_within(seconds: float, call: Any) -> StoreError:
    """The StoreError ``call`` raises, which it must within ``seconds``."""
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        await asyncio.wait_for(call, seconds + 10)
    assert time.monotonic() - start < seconds, (time.monotonic() - start, info.value)
    return info.value


async def test_connecting_waits_ckptd_connect_timeout_not_the_request_timeout(
        full: str, knobs_for: Any) -> None:
    """Connecting waited CKPTD_REQUEST_TIMEOUT (60 s) per attempt."""
    knobs_for(CONNECT_TIMEOUT="0.5", REQUEST_TIMEOUT="30", RETRIES="0")
    store = S3Store(BUCKET, "p", endpoint_url=full)
    try:
        error = await failing_within(3, store.exists("k"))
        assert "timeout" in str(error).lower()
    finally:
        await store.close()


async def test_a_write_to_an_endpoint_that_never_answers_times_out(
        silent: str, knobs_for: Any) -> None:
    """A PutObject waited for "100 Continue" forever, whatever CKPTD_REQUEST_TIMEOUT."""
    knobs_for(REQUEST_TIMEOUT="0.5", RETRIES="1", RETRY_BACKOFF="0")
    store = S3Store(BUCKET, "p", endpoint_url=silent)
    try:
        error = await failing_within(4, store.put_if_absent("k", b"x"))
        assert "Read timeout" in str(error)
    finally:
        await store.close()


async def test_a_failed_probe_deletes_only_what_it_wrote_once(knobs_for: Any) -> None:
    """`ckptd serve` at an endpoint that refuses connections took 33 s to say so: the
    probe then deleted its four keys, each with every retry."""
    knobs_for(RETRIES="2", CONNECT_TIMEOUT="1")
    store = S3Store(BUCKET, "p", endpoint_url=f"http://127.0.0.1:{free_port()}")
    try:
        sent = await Sent().watch(store)
        start = time.monotonic()
        with pytest.raises(StoreError, match="PutObject"):
            await conditional_write_gaps(store)
        took = time.monotonic() - start
        puts = [key for op, key in sent.requests if op == "PutObject"]
        deleted = {key for op, key in sent.requests if op == "DeleteObject"}
        assert len(puts) == 3 and deleted <= {puts[0]}, sent.requests
        assert took < 10, took  # the put's three attempts, then one delete of 1 s at most
    finally:
        await store.close()


async def test_a_cancelled_probe_ends_in_bounded_time(silent: str, knobs_for: Any) -> None:
    """SIGTERM on `ckptd serve --check` at an endpoint that never answers took 78 s."""
    knobs_for(REQUEST_TIMEOUT="30", CONNECT_TIMEOUT="1")
    store = S3Store(BUCKET, "p", endpoint_url=silent)
    try:
        probe = asyncio.ensure_future(conditional_write_gaps(store))
        await asyncio.sleep(0.5)  # its first write sent, waiting for an answer
        probe.cancel()
        start = time.monotonic()
        await asyncio.wait([probe], timeout=20)
        assert probe.cancelled() and time.monotonic() - start < 2.5
    finally:
        await store.close()


async def test_https_at_a_plain_http_s3_says_use_http_at_once(
        endpoint: str, knobs_for: Any) -> None:
    """It said 'nothing answered ... check that this host reaches it' after retries."""
    knobs_for(RETRIES="4")
    tls = endpoint.replace("http://", "https://")
    store = S3Store(BUCKET, "p", endpoint_url=tls)
    try:
        sent = await Sent().watch(store)
        error = await failing_within(5, store.list_dir(""))
        assert f"?endpoint={endpoint}" in str(error), error
        assert len(sent.requests) == 1, sent.requests
    finally:
        await store.close()


async def test_a_host_name_that_does_not_resolve_is_named_at_once(knobs_for: Any) -> None:
    """It was retried for 12 s, then said 'nothing answered'."""
    knobs_for(RETRIES="4")
    store = S3Store(BUCKET, "p", endpoint_url="http://ckptd-no-such-host.invalid:9000")
    try:
        sent = await Sent().watch(store)
        error = await failing_within(5, store.exists("k"))
        assert "'ckptd-no-such-host.invalid' does not resolve" in str(error), error
        assert len(sent.requests) == 1, sent.requests
    finally:
        await store.close()


class _NotS3(BaseHTTPRequestHandler):
    """Another program: 404 Not Found, as a web page, to everything."""

    def _not_found(self) -> None:
        body = b"<html><body><h1>Not Found</h1></body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_DELETE = _not_found

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def not_s3() -> Iterator[str]:
    with http_program(_NotS3) as url:
        yield url


async def test_an_endpoint_that_is_another_program_is_said_to_be_one(not_s3: str) -> None:
    store = S3Store(BUCKET, "p", endpoint_url=not_s3)
    try:
        error = await failing_within(5, store.list_dir(""))
        assert "does not look like an S3 API" in str(error), error
    finally:
        await store.close()


class ExpiredToken:
    """Fault injection: the next answer is AWS's to a session token past its expiry
    (moto checks none), after the request reached moto."""

    def __init__(self) -> None:
        self.answered = 0

    def __call__(self, response_dict: dict[str, Any], **_: Any) -> None:
        self.answered += 1
        response_dict["status_code"] = 400
        response_dict["body"] = (b"<Error><Code>ExpiredToken</Code><Message>The provided "
                                 b"token has expired.</Message></Error>")


async def test_an_expired_session_token_says_to_refresh_the_credentials(endpoint: str) -> None:
    store = S3Store(BUCKET, "p", endpoint_url=endpoint)
    try:
        fault = ExpiredToken()
        (await store._client()).meta.events.register("before-parse.s3", fault)
        error = await failing_within(5, store.get("k"))
        assert fault.answered == 1 and error.detail["s3_code"] == "ExpiredToken"
        assert "refresh the credentials" in str(error), error
    finally:
        await store.close()


def test_only_a_handshake_that_fails_for_good_is_not_retried() -> None:
    """(Found by review.) Every TLS error failed at once, a handshake a load balancer
    cut short too, which the next attempt may pass."""
    import ssl

    from botocore.exceptions import SSLError as BotoSSLError

    from ckptd.store.s3_advice import tls_for_good

    def boto(inner: BaseException) -> BotoSSLError:
        return BotoSSLError(endpoint_url="https://s3.example", error=inner)

    plain = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    cut = ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:1006)")
    untrusted = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] "
                                             "certificate verify failed")
    assert tls_for_good(boto(plain)) and tls_for_good(boto(untrusted))
    assert not tls_for_good(boto(cut))
    assert not tls_for_good(boto(ConnectionResetError(104, "Connection reset by peer")))
