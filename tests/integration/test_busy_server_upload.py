"""A busy server is not a vanished one: while its ingest budget is spent, a
``ckptd serve`` stops reading an upload's body for up to ``--ingest-wait`` (10 s)
before it admits it (or answers 503). Its kernel still acknowledges everything and
answers every probe, but the receive window stays shut; Linux ends such a
connection once TCP_USER_TIMEOUT passes (zero-window probes count too). With the
client's user timeout at twice the connect timeout (6 s), a live server's upload
was cut mid-body, sent again, and its replica marked down as if its host were gone.

A real ``ckptd serve`` with a 1 MiB ingest budget; a raw connection holds that
budget by sending a chunk upload slowly, for less than the server's ingest wait;
meanwhile the client's transport uploads a chunk larger than the socket buffers."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from ckptd import knobs
from ckptd.client.transport import HttpTransport
from ckptd.hashing import chunk_id
from tests.conftest import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HOLD_S = 8.5  # under the server's ingest wait (10 s), over twice the connect timeout


def test_an_upload_a_busy_server_holds_back_is_not_cut(tmp_path: Path) -> None:
    assert 2 * knobs.connect_timeout() < HOLD_S
    server = ServerProcess(store=tmp_path / "store", env={"CKPTD_INGEST_BUDGET": str(1 << 20)})
    server.start()
    blob = os.urandom(1 << 20)
    holder = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        # The holder's upload takes the whole budget and sends its body slowly.
        holder.sendall(f"PUT /v1/chunks/{chunk_id(blob)} HTTP/1.1\r\nHost: ckptd\r\n"
                       "Content-Type: application/octet-stream\r\n"
                       f"Content-Length: {len(blob)}\r\n\r\n".encode() + blob[:1024])
        answers: list[bytes] = []

        def finish() -> None:
            time.sleep(HOLD_S)
            holder.sendall(blob[1024:])
            answers.append(holder.recv(64))

        finishing = threading.Thread(target=finish, daemon=True)
        finishing.start()
        time.sleep(0.5)  # the holder's head is in: the budget is spent
        data = os.urandom(32 << 20)  # past what the socket buffers take in

        async def upload() -> tuple[bool, list[str], float]:
            transport = HttpTransport(server.url, job="busy")
            try:
                t0 = time.monotonic()
                created = await transport.put_chunk(chunk_id(data), data)
                return created, transport.members.live(), time.monotonic() - t0
            finally:
                await transport.close()

        created, live, took = asyncio.run(upload())
        finishing.join(30)
        assert answers and answers[0].startswith(b"HTTP/1.1 201")
        assert created
        # Admitted once the holder was done: one try, the replica never marked down.
        assert live == [server.url], "the busy server's upload was cut as if its host were gone"
        assert HOLD_S - 1 < took < HOLD_S + 5
    finally:
        holder.close()
        server.stop()
