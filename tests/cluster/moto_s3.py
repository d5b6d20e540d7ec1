"""moto's S3 server in a process of its own, one request at a time (S3's atomic
conditional writes; see tests/store/test_s3.py), with one bucket. Prints its URL.

    python -m tests.cluster.moto_s3 PORT BUCKET
"""

from __future__ import annotations

import logging
import sys
import threading

import boto3
from moto import server as moto_server

from tests.store.test_s3 import _OneRequestAtATime


def main() -> None:
    port, bucket = int(sys.argv[1]), sys.argv[2]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer("127.0.0.1", port, verbose=False)
    server.start()
    server._server.app = _OneRequestAtATime(server._server.app)  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    print(url, flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
