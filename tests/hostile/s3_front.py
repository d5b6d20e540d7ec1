"""An HTTP front for an S3 endpoint that drops the conditional headers
(``If-None-Match``, ``If-Match``) of every request and passes the rest on: what
a careless gateway or proxy does. A real server on 127.0.0.1 (a thread), for
tests that need a store which takes conditional writes and ignores them."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

DROPPED = frozenset({"if-none-match", "if-match"})
# Hop-by-hop headers, and the length: set again for what is forwarded.
_NOT_FORWARDED = DROPPED | {"connection", "keep-alive", "transfer-encoding", "content-length",
                            "proxy-connection", "te", "trailer", "upgrade", "expect"}


class DroppingFront:
    """Forwards to ``upstream`` (http://host:port); ``dropped`` counts the
    conditional headers it removed."""

    def __init__(self, upstream: str) -> None:
        target = urlparse(upstream)
        assert target.hostname is not None and target.port is not None
        host, port = target.hostname, target.port
        self.dropped = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts: list[bytes] = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _NOT_FORWARDED}
                front.dropped += sum(1 for k in self.headers if k.lower() in DROPPED)
                conn = http.client.HTTPConnection(host, port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in _NOT_FORWARDED:
                        self.send_header(k, v)
                # A HEAD answer's length is the object's, not of the (absent) body.
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
