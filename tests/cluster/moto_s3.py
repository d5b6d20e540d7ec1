"""moto's S3 server in a process of its own, one request at a time (S3's atomic
conditional writes; see tests/store/test_s3.py), with one bucket. Prints its URL.

    python -m tests.cluster.moto_s3 PORT BUCKET
"""

from __future__ import annotations

import sys
import threading

import boto3

from ckptd.testing.moto_s3 import serve


def main() -> None:
    port, bucket = int(sys.argv[1]), sys.argv[2]
    serve("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    print(url, flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
