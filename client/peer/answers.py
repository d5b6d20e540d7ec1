"""An HTTP/1.1 answer read off a blocking socket, for ``PeerClient``: its head, its
body straight into the caller's buffers (plain or chunked), and the typed error of
an answer that is not a 200."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Mapping

from ckptd.errors import ChunkNotFound, CkptdError, Conflict, Unavailable, from_json


class Disconnected(ConnectionError):
    """The peer closed the connection."""


def check_deadline(deadline: float, more: bool = True) -> None:
    """Past the request's deadline with more to read: the peer is too slow."""
    if more and time.monotonic() > deadline:
        raise TimeoutError("the answer did not arrive in time")


def read_head(sock: socket.socket, deadline: float = float("inf")
               ) -> tuple[int, dict[str, str], memoryview]:
    """An answer's status and headers, and what was received past them."""
    head = bytearray()
    scratch = bytearray(16384)
    end = -1
    while end < 0:
        k = sock.recv_into(scratch)
        if not k:
            raise Disconnected("connection closed before the answer")
        head += memoryview(scratch)[:k]
        end = head.find(b"\r\n\r\n", max(0, len(head) - k - 3))
        if end < 0 and len(head) > 65536:
            raise ValueError("answer headers longer than 64 KiB")
        check_deadline(deadline, end < 0)
    status, headers = parse_head(bytes(head[:end]))
    return status, headers, memoryview(head)[end + 4 :]


def content_length(headers: Mapping[str, str]) -> int:
    length = headers.get("content-length", "")
    return int(length) if length.isdigit() else -1


def keep_alive(headers: Mapping[str, str]) -> bool:
    return headers.get("connection", "").lower() != "close"


class BodyStream:
    """An answer's body, read in order: first what came with the headers, then the
    socket, straight into the caller's buffers."""

    def __init__(self, sock: socket.socket, extra: memoryview,
                 deadline: float = float("inf"), flags: int = socket.MSG_WAITALL) -> None:
        self.sock = sock
        self.extra = extra
        self.deadline = deadline
        self.flags = flags

    def read_into(self, dest: memoryview) -> None:
        got = min(len(self.extra), len(dest))
        dest[:got] = self.extra[:got]
        self.extra = self.extra[got:]
        while got < len(dest):
            k = self.sock.recv_into(dest[got:], len(dest) - got, self.flags)
            if not k:
                raise Disconnected(f"the answer ended {len(dest) - got} bytes short")
            got += k
            check_deadline(self.deadline, got < len(dest))

    def line(self) -> bytes:
        """The next line (without its CRLF), from what came already, else read a
        little at a time (never far past it: a body follows)."""
        while (end := bytes(self.extra[:MAX_LINE]).find(b"\r\n")) < 0:
            if len(self.extra) >= MAX_LINE:
                raise ValueError("a line of a chunked answer longer than 4 KiB")
            more = bytearray(256)
            k = self.sock.recv_into(more)
            if not k:
                raise Disconnected("the answer ended inside a chunk header")
            self.extra = memoryview(bytes(self.extra) + bytes(more[:k]))
            check_deadline(self.deadline)
        out = bytes(self.extra[:end])
        self.extra = self.extra[end + 2 :]
        return out

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, len(scratch))
            self.read_into(scratch[:k])
            n -= k


MAX_LINE = 4096


def chunk_size(line: bytes) -> int:
    """The size of a chunk of a chunked body, from its line (extensions ignored)."""
    text = line.split(b";", 1)[0].strip()
    if not text or len(text) > 16 or text.strip(b"0123456789abcdefABCDEF"):
        raise ValueError(f"bad chunk size line {line[:40]!r}")
    return int(text, 16)


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


def answer_error(status: int, body: bytes, url: str, cid: str | None) -> CkptdError:
    """The typed error of an answer that is not a 200 (``cid`` None: a read of several
    chunks, whose answer without a ckptd error body says nothing of any one chunk)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("code"), str):
        err = from_json(doc, status)
        err.detail.setdefault("peer", url)
        return err
    if cid is None:
        return Unavailable(f"{url} answered {status} to a read of several chunks", peer=url,
                           reason="status", status=status)
    if status == 404:
        return ChunkNotFound(f"{url} does not hold chunk {cid}", id=cid, peer=url)
    if status == 409:
        return Conflict(f"peer {url}: chunk {cid} is being overwritten", id=cid, peer=url)
    # An object store's error names itself in XML (<Code>AccessDenied</Code>, and a
    # <Message> such as "Request has expired"): say what it said.
    said = " ".join(m.group(1).decode("utf-8", "replace")[:200] for m in
                    _XML_SAID.finditer(body[:4096]))
    return Unavailable(f"{url} answered {status} for chunk {cid}" + (f": {said}" if said else ""),
                       peer=url, reason="status", status=status)


_XML_SAID = re.compile(rb"<(?:Code|Message)>([^<]*)</(?:Code|Message)>")
