"""moto's S3 server with S3's atomic conditional writes, for a local cluster
(``deploy/compose/local-cluster.sh``) and the tests.

moto checks ``If-None-Match`` / ``If-Match`` and then writes, with no lock between,
in a threaded server; S3 does both as one step. Replicas that start together probe
their store's conditional writes with racing writers (``ckptd.store.probe``): on a
loaded machine moto let two of them win, and a replica refused to start, saying
its store could not write conditionally. Serving one request at a time gives moto
S3's atomicity.

    python -m ckptd.testing.moto_s3 [--host 127.0.0.1] --port 9000

Needs ``moto[server]`` (not a dependency of ckptd)."""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any


class OneRequestAtATime:
    """A WSGI app that serves ``app``'s requests one at a time."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self.lock:
            return list(self.app(environ, start_response))


def serve(host: str, port: int) -> Any:
    """Starts moto's threaded server at ``host:port``, one request at a time, and
    returns it: it runs in a thread of its own until its ``stop()``."""
    from moto import server as moto_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # (a line per request)
    server = moto_server.ThreadedMotoServer(host, port, verbose=False)
    server.start()
    wsgi = server._server
    assert wsgi is not None  # (started above)
    wsgi.app = OneRequestAtATime(wsgi.app)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m ckptd.testing.moto_s3",
                                     description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    serve(args.host, args.port)
    print(f"http://{args.host}:{args.port}", flush=True)
    threading.Event().wait()  # until stopped


if __name__ == "__main__":
    main()
