"""An HTTP relay in front of a real ``ckptd serve``, for tests of what a client
meets between it and the server: answers a newer server would give (``change``),
answers that come late (``delay``), and requests met by a closed connection
(``drop``). Loopback only; a thread per request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

# Headers the relay sets itself (or that describe the hop, not the answer).
_HOP = ("content-length", "transfer-encoding", "connection", "content-encoding", "date",
        "server")


@contextmanager
def relay(upstream: str, *, change: Callable[[Any], Any] | None = None,
          delay: Callable[[str, str], float] | None = None,
          drop: Callable[[str, str], bool] | None = None) -> Iterator[str]:
    """The relay's URL, relaying to ``upstream``: each JSON answer passed through
    ``change``, each request held ``delay(method, path)`` seconds first, and one for
    which ``drop(method, path)`` is true answered by closing its connection (what a
    server does to a kept-alive connection it closes as idle as the request comes)."""

    class Relay(BaseHTTPRequestHandler):
        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if drop is not None and drop(self.command, self.path):
                self.close_connection = True
                return
            wait = delay(self.command, self.path) if delay is not None else 0.0
            if wait > 0:
                time.sleep(wait)
            answer = httpx.request(
                self.command, upstream + self.path, timeout=60, content=body,
                headers={k: v for k, v in self.headers.items()
                         if k.lower() not in ("host", "content-length", "connection")})
            out = answer.content
            kind = answer.headers.get("content-type", "")
            if (change is not None and kind.startswith("application/json")
                    and answer.is_success and out):
                out = json.dumps(change(json.loads(out))).encode()
            self.send_response(answer.status_code)
            for key, value in answer.headers.items():
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _relay

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Relay) as server:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
