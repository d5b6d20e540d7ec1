"""Direct reads from the object store stop after it dropped connections in a row,
not after a few drops spread over a long restore (review: three drops across 10,000
chunks stopped them for good); a name a resolver could not look up for now is not
a host that is not there."""

from __future__ import annotations

import asyncio
import socket
from http.server import BaseHTTPRequestHandler

import pytest

from ckptd.client.peer.client import _connect_failure
from ckptd.client.restore.direct import DROPS_ALLOWED, ObjectStoreSource
from ckptd.errors import Unavailable
from ckptd.hashing import chunk_id
from tests.listeners import http_program

BODY = b"chunk bytes " * 100
CID = chunk_id(BODY)


class _Flaky(BaseHTTPRequestHandler):
    """``/good`` answers the chunk; ``/drop`` closes the connection unanswered."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802  (http.server's names)
        if self.path.startswith("/drop"):
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *_: object) -> None:
        pass


def test_drops_between_good_reads_do_not_stop_direct_reads() -> None:
    async def run(url: str) -> ObjectStoreSource:
        reads = {CID: f"{url}/good", "d" * 64: f"{url}/drop"}
        src = ObjectStoreSource(reads, None, timeout=5.0)
        dest = memoryview(bytearray(len(BODY)))
        try:
            for _ in range(3):
                for _ in range(DROPS_ALLOWED - 1):
                    with pytest.raises(Unavailable):
                        await src.fetch_into("object store", "d" * 64, dest)
                assert await src.fetch_into("object store", CID, dest) == CID
            assert src.stopped is None, src.stopped
            for _ in range(DROPS_ALLOWED):  # in a row: stopped
                with pytest.raises(Unavailable):
                    await src.fetch_into("object store", "d" * 64, dest)
            assert src.stopped is not None and "in a row" in src.stopped
        finally:
            src.close()
        return src

    with http_program(_Flaky) as url:
        asyncio.run(run(url))


def test_a_resolver_that_failed_for_now_is_not_a_host_gone() -> None:
    assert _connect_failure(socket.gaierror(socket.EAI_NONAME, "Name or service not known")
                            ) == "unreachable"
    assert _connect_failure(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name "
                                            "resolution")) == "failed"
