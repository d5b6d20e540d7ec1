"""What a test puts on a loopback port in place of a ckptd server or an object store:
a listener that takes connections and never answers (a stopped process, a wedged
one), and another program's HTTP server (a mistyped URL)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def silent_listener() -> Iterator[str]:
    """The URL of a port whose connections the kernel takes (its backlog) and no one
    ever answers: the bytes sent are taken, nothing comes back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def http_program(handler: type[BaseHTTPRequestHandler] | Callable[..., Any]) -> Iterator[str]:
    """The URL of an HTTP server answering with ``handler`` (not ckptd, not S3)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
